"""The step-event decoder's fast paths (a raw reply's flat list, the bounded read's NUL-joined entry) accept
exactly what the field-by-field path accepts, build an equal StepEvent, and leave every refusal, and its
words, to that path (issue 35: the operator decodes 32,000 entries a second at 1000 jobs)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate_runtime.contract import events as ev

WRITTEN = ev.encode(
    ev.StepEvent(
        role="trainer",
        gen=3,
        step=17,
        phase="finished",
        result="ok",
        seconds=0.5,
        phase_seconds={"publish": 0.25},
        bytes=1 << 30,
        handles=4,
        replica=2,
        rank=5,
        gpu="GPU-a",
        weight_version="v17",
    ),
    now=1.0,
)
# Values an entry may hold in any field: edge cases of the number parsers, the enums, the bounds.
TRICKY = [
    "",
    "0",
    "1",
    "-1",
    " 7 ",
    "1_0",
    "+5",
    "1e3",
    "0x10",
    "٣",
    "nan",
    "inf",
    "-inf",
    "1.5",
    str(2**62),
    str(2**62 - 1),
    "true",
    "false",
    "True",
    "trainer",
    "reader",
    "rollout",
    "preflight",
    "ok",
    "error",
    "PreflightPassed",
    "{}",
    "[]",
    '{"a": 1}',
    '{"a": "2"}',
    '{"a": Infinity}',
    "{" + ",".join(f'"p{i}": 1' for i in range(17)) + "}",
    "G" * 129,
    "x" * 1025,
    "é" * 600,
    "a\0b",
]
TRICKY_BYTES = [b"\xff", b"\xc3", b"\x80abc"]


def outcome(decoder: object, fields: object) -> object:
    try:
        event = decoder(fields)  # type: ignore[operator]
    except ev.EventError as e:
        return ("error", str(e))
    assert type(event) is ev.StepEvent
    return dataclasses.astuple(event)


def flat(fields: dict[str, str]) -> list[bytes]:
    return [x.encode() for pair in fields.items() for x in pair]


@st.composite
def entries(draw: st.DrawFn) -> list[bytes]:
    """An entry as `encode` writes it (sometimes with `reason`, sometimes with rollout figures), then some
    values replaced, keys renamed, moved or repeated, or the list cut."""
    fields = dict(WRITTEN)
    if draw(st.booleans()):
        fields["reason"] = draw(st.sampled_from(["", "PreflightPassed", "Nope", "ShmNotShared"]))
    if draw(st.integers(0, 9)) == 0:
        fields.update({k: "0.1" for k in ev.ROLLOUT_FIELDS})
    raw = flat(fields)
    values = st.one_of(
        st.sampled_from(TRICKY).map(str.encode), st.sampled_from(TRICKY_BYTES), st.binary(max_size=8)
    )
    for _ in range(draw(st.integers(0, 3))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(values)
    if draw(st.integers(0, 5)) == 0:
        i, j = draw(st.integers(0, len(raw) - 1)), draw(st.integers(0, len(raw) - 1))
        raw[i], raw[j] = raw[j], raw[i]
    if draw(st.integers(0, 5)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    if draw(st.integers(0, 5)) == 0:
        raw += [b"gpu", draw(values)]
    return raw


@settings(max_examples=3000, deadline=None)
@given(entries())
def test_the_fast_paths_decide_and_word_as_the_checked_path(raw: list[bytes]) -> None:
    expected = outcome(ev._decode_checked, raw)
    assert outcome(ev.decode, raw) == expected
    if raw and all(b"\0" not in x for x in raw):  # as the bounded read joins them
        assert outcome(ev.decode_joined, b"\0".join(raw)) == expected


@pytest.mark.parametrize(
    "fields",
    [
        WRITTEN,
        {**WRITTEN, "reason": "PreflightPassed", "phase": "preflight"},
        {**WRITTEN, "phase_seconds": "{}", "error": "e" * 600},
        {**WRITTEN, "gpu": "GPU-é"},  # not ASCII: the joined path hands it to the checked one
    ],
)
def test_entries_as_written_take_the_fast_path_and_decode_alike(fields: dict[str, str]) -> None:
    raw = flat(fields)
    assert ev._decode_written(raw) is not None
    event = ev.decode(raw)
    assert event == ev._decode_checked(raw) == ev.decode_joined(b"\0".join(raw))
    assert event.phase_seconds == json.loads(fields["phase_seconds"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.step = 1  # type: ignore[misc]


def test_the_unchecked_twin_has_the_step_events_layout() -> None:
    assert ev._Filled.__slots__ == ev.StepEvent.__slots__
    assert list(ev.encode(ev.StepEvent(role="trainer", gen=0, step=0, phase="opened"))) == ev._WRITTEN_KEYS
