"""The step-event codec reads what pods wrote: every hostile entry is one EventError with a short message,
never another exception (H4 of the security review)."""

from __future__ import annotations

import json

import pytest

from colocate_runtime.contract import events as ev

GOOD = ev.encode(ev.StepEvent(role="trainer", gen=1, step=3, phase="finished", result="ok", gpu="GPU-a"))

HOSTILE: dict[str, dict[object, object]] = {
    "non-UTF-8 value": {**GOOD, "gpu": b"\xff\xfe\xfa"},
    "non-UTF-8 key": {**GOOD, b"\xc3\x28": "x"},
    "non-UTF-8 in every field": {k.encode(): b"\x80" + v.encode() for k, v in GOOD.items()},
    "oversized error": {**GOOD, "error": "e" * 100_000},
    "oversized key": {**GOOD, "k" * 5000: "1"},
    "long gpu": {**GOOD, "gpu": "G" * 129},
    "long weight version": {**GOOD, "weight_version": "9" * 200},
    "many fields": {**GOOD, **{f"x{i}": "1" for i in range(40)}},
    "negative step": {**GOOD, "step": "-1"},
    "huge step": {**GOOD, "step": str(2**62)},
    "4301-digit step": {**GOOD, "step": "9" * 1000},
    "nan seconds": {**GOOD, "seconds": "nan"},
    "inf ts": {**GOOD, "ts": "inf"},
    "phase_seconds list": {**GOOD, "phase_seconds": "[1, 2]"},
    "phase_seconds nested": {**GOOD, "phase_seconds": "[" * 1000},
    "phase_seconds too many": {**GOOD, "phase_seconds": json.dumps({f"p{i}": 1 for i in range(20)})},
    "phase_seconds non-number": {**GOOD, "phase_seconds": '{"a": [1]}'},
    "phase_seconds inf": {**GOOD, "phase_seconds": '{"a": Infinity}'},
    "missing v": {k: v for k, v in GOOD.items() if k != "v"},
    "v as garbage": {**GOOD, "v": b"\xff"},
    "empty": {},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_entries_raise_one_short_event_error(case: str) -> None:
    with pytest.raises(ev.EventError) as caught:
        ev.decode(HOSTILE[case])
    assert len(str(caught.value)) < 400, "the message of a skipped entry is bounded"


def _flat(fields: dict[object, object]) -> list[object]:
    """An entry's fields as the server sends them in a raw XREAD reply."""
    return [x for pair in fields.items() for x in pair]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_entries_in_the_flat_form_raise_one_short_event_error(case: str) -> None:
    with pytest.raises(ev.EventError) as caught:
        ev.decode(_flat(HOSTILE[case]))
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(
    "fields",
    [
        [b"v", b"1", b"role"],  # a key without its value
        None,  # a deleted entry, as an XREAD reply shows it
        42,
        [[b"v"], [b"1"]],  # keys that are not strings
    ],
)
def test_malformed_flat_entries_raise_an_event_error(fields: object) -> None:
    with pytest.raises(ev.EventError):
        ev.decode(fields)  # type: ignore[arg-type]


def test_the_flat_form_decodes_as_the_mapping_does() -> None:
    raw = {k.encode(): v.encode() for k, v in GOOD.items()}
    assert ev.decode(_flat(raw)) == ev.decode(raw) == ev.decode(GOOD)
    # A repeated key: the last value wins, as in a mapping built from the pairs.
    assert ev.decode([*_flat(raw), b"gpu", b"GPU-b"]).gpu == "GPU-b"


def test_the_encoder_output_stays_inside_the_bounds() -> None:
    event = ev.StepEvent(
        role="trainer",
        gen=2**40,
        step=2**40,
        phase="failed",
        result="error",
        error="x" * 10_000,
        gpu="GPU-" + "f" * 100,
        weight_version="v" * 128,
        phase_seconds={p: 1.0 for p in ev.PHASES},
    )
    fields = ev.encode(event)
    decoded = ev.decode({k.encode(): v.encode() for k, v in fields.items()})
    assert decoded.error == "x" * ev.ERROR_MAX_CHARS and decoded.step == 2**40
    assert decoded.gpu == event.gpu and decoded.weight_version == event.weight_version
