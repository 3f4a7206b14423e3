"""EventSource, the one constructor of step events: identity on every event, the preflight shape, and what it
makes survives the stream codec."""

from __future__ import annotations

import pytest

from colocate_runtime.contract import events as ev

SOURCE = ev.EventSource("trainer", replica=2, rank=5, gpu="GPU-a")


def test_every_event_carries_the_source_and_survives_the_codec() -> None:
    timings = {"publish": 0.25}
    event = SOURCE.event(
        3,
        17,
        "finished",
        result="ok",
        seconds=0.5,
        phase_seconds=timings,
        nbytes=1 << 20,
        handles=4,
        weight_version="v17",
    )
    timings["publish"] = 9.0  # the caller's dict is copied, not shared
    assert (event.role, event.replica, event.rank, event.gpu) == ("trainer", 2, 5, "GPU-a")
    assert (event.gen, event.step, event.phase, event.bytes, event.handles) == (3, 17, "finished", 1 << 20, 4)
    assert event.phase_seconds == {"publish": 0.25}
    assert ev.decode(ev.encode(event, now=1.0)) == ev.StepEvent(**{**_fields(event), "ts": 1.0})


def test_preflight_records_are_step_zero_with_one_buffer() -> None:
    reader = ev.EventSource("reader", replica=0, rank=1, gpu="GPU-b")
    event = reader.preflight(
        4, nbytes=4096, seconds=0.1, result="error", reason=ev.PEER_TIMEOUT, error="late"
    )
    assert (event.phase, event.step, event.handles, event.bytes) == ("preflight", 0, 1, 4096)
    assert (event.role, event.gen, event.reason, event.error) == ("reader", 4, ev.PEER_TIMEOUT, "late")


def test_a_bad_phase_or_role_is_refused_where_the_event_is_made() -> None:
    with pytest.raises(ev.EventError, match="phase"):
        SOURCE.event(1, 1, "teleported")
    with pytest.raises(ev.EventError, match="role"):
        ev.EventSource("operator").event(1, 1, "finished")


def _fields(event: ev.StepEvent) -> dict:
    return {name: getattr(event, name) for name in ev.StepEvent.__dataclass_fields__}
