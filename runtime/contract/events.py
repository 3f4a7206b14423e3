"""Step events: the contract between the in-pod runtime and the operator (pure encode/decode + XADD).

Stream key, one per job: `colocate:{namespace}:{job}:events`, where `namespace` and `job` are the values of
`COLOCATE_NAMESPACE` and `COLOCATE_JOB_NAME` (see config.py). The stream is capped (`XADD MAXLEN ~ 10000`);
it is written with `XADD` by the trainer-side writer and the SGLang-side reader of every pod and GPU.

Every entry has these fields, as strings (Redis stream values are strings); `reason` is optional (only
preflight events carry it, and a decoder must accept entries without it):

| field | meaning |
|---|---|
| `v` | schema version of the event, `1` |
| `role` | `trainer` (writer) or `reader` (SGLang side) |
| `gen` | trainer incarnation (a restarted trainer has a larger one; ignore steps of older ones) |
| `step` | the trainer's optimizer step |
| `phase` | see below |
| `result` | `ok`, `error`, `aborted`, `timeout`, `peer_lost`, `metastore_lost`; empty mid-step |
| `seconds` | duration of this phase; for `finished`, the whole step on that side |
| `phase_seconds` | JSON object phase -> seconds (on `finished`, `failed`), e.g. `{"publish": 0.001, ...}` |
| `bytes` | payload bytes of the step on this GPU |
| `handles` | number of IPC handles (buckets) of the step on this GPU |
| `replica` | pod index (`COLOCATE_REPLICA_INDEX`) |
| `rank` | process rank (trainer rank or SGLang TP rank) |
| `gpu` | GPU UUID |
| `weight_version` | the version the step installs in SGLang |
| `final` | `true` only on the last record of a training run, else `false` |
| `error` | short message on `failed` (at most 512 characters; never contains secrets), else empty |
| `reason` | optional, `preflight` only: the CamelCase outcome (`PREFLIGHT_REASONS`), absent when empty |
| `ts` | wall-clock time of the event, Unix seconds |

A `rollout` event (trainer, once per step: runtime/consistency.py) also carries these, all or none; other
phases carry none of them:

| field | meaning |
|---|---|
| `kl` | K3 estimate of KL(engine ‖ trainer) over the step's sampled tokens, mean per token (>= 0) |
| `logp_diff_mean` | mean over the tokens of abs(trainer log-prob - engine log-prob) |
| `logp_diff_max` | the largest of them |
| `logp_over` | fraction of the tokens whose difference is over `logp_threshold`, in [0, 1] |
| `logp_threshold` | that threshold (nats) |
| `tokens` | tokens compared (over every data-parallel rank) |

Phases, in order. Trainer: `published` (manifest and handles written; `seconds` covers packing and
publishing), `acked` (ACK received; `seconds` = wait), `freed` (buckets returned), `finished`. Reader:
`opened`, `copied`, `closed` (verified forced IPC close), `acked`, `finished`. The trainer writes
`ack_rejected` (`result=error`, the reason in `error`) for an ACK it refused: one that the step's claimant did
not write, or that does not decode; the step goes on waiting. Either side: `failed` with a
`result` other than `ok`. At the end of training the trainer writes one record with `phase=final`,
`final=true`, `step` = last step, `result` = `ok` or `error`: success of the job needs this record, not exit
codes. `completed` (summary mode only, below): the step finished on every GPU of the job.

Where the trainer compares the engine's log-probs of the tokens it sampled with its own
(runtime/consistency.py, `Publisher.report_rollout`), it writes one `phase=rollout` record per step with
`result=ok` and the figures above: `step` is the training step whose rollouts were compared (they were
generated from the weights the previous `update` installed). The operator folds them into
`status.rollout.consistency`.

Before its first step each trainer process runs the IPC preflight on its GPU (preflight.py):
`phase=preflight`, `step=0`, `gen` = the incarnation. The trainer writes one with an empty `result` when an
attempt starts and one with `result=ok` (`reason=PreflightPassed`) or `result=error` and a failure `reason`
when it ends; the reader side writes one with its own verdict. A pass holds for that incarnation only.

Readers treat entries as untrusted (any container of the job can write them): `decode` refuses an entry with
more than 32 fields, a key or value over 1024 bytes, bytes that are not UTF-8, `gpu` or `weight_version` over
128 characters, counts outside [0, 2**62), non-finite numbers, a `rollout` record without its figures (or
figures out of their ranges, or on another phase), always with an `EventError`.

Writers make events through one `EventSource` (their role, replica, rank and GPU) so that no two assemble
them differently.

For status, the operator needs only the trainer's `finished`, `completed`, `failed`, `final` and `preflight`
records: a step is complete when each GPU of the job has a trainer `finished` record with `result=ok` for
that step, or when one `completed` record says so.

Summary mode (`COLOCATE_STEP_SUMMARY_GPUS`, which the operator sets; runtime/colocated/step_summary.py).
Per-GPU records cost the reader of the stream per GPU and step: 32 a step for a 32-GPU job, 256 with every
phase. In summary mode a trainer's `finished` record with `result=ok` is not added to the stream: it is
kept in the job's store until the job's last GPU finishes that step, and then one `completed` record is
added (`seconds` the slowest GPU's, `bytes` and `handles` the sums, `ts` the latest, `gpu` empty, the
other fields the last GPU's). The progress phases (`DETAIL_PHASES`, and the reader's `finished`) are
written by the processes of replica 0, rank 0 only, so the job's current phase still shows. Failures,
preflight, rollout, `ack_rejected` and `final` records are written as in the detailed mode.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from colocate_runtime.contract.jobkeys import job_prefix

SCHEMA_VERSION = 1
STREAM_MAXLEN = 10_000
ERROR_MAX_CHARS = 512
# Bounds a decoder holds every entry to: the stream is written by pods, so the operator reads it as untrusted.
FIELD_MAX_BYTES = 1024  # any one key or value (the writer cuts `error` to ERROR_MAX_CHARS)
NAME_MAX_CHARS = 128  # gpu, weight_version: they reach status and condition messages
ENTRY_MAX_FIELDS = 32
PHASE_SECONDS_MAX = 16
NUMBER_MAX = 2**62  # gen, step, bytes, handles, replica, rank: non-negative and below this

PHASES = (
    "published",
    "opened",
    "copied",
    "closed",
    "acked",
    "freed",
    "finished",
    "failed",
    "final",
    "preflight",
    "ack_rejected",  # trainer: an ACK not from the step's claimant (or not decodable) was refused
    "rollout",  # trainer: the engine's log-probs against the trainer's for the step (RolloutFigures)
    "completed",  # trainer, summary mode: the step finished on every GPU of the job (one record a step)
)
# Per-GPU progress within a step: what summary mode writes for one process of the job only (`is_detail`).
DETAIL_PHASES = frozenset({"published", "opened", "copied", "closed", "acked", "freed"})
RESULTS = ("", "ok", "error", "aborted", "timeout", "peer_lost", "metastore_lost")


# Outcomes of the IPC preflight (the `reason` of preflight events; the operator's IPCReady reasons).
PREFLIGHT_PASSED = "PreflightPassed"
SHM_NOT_SHARED = "ShmNotShared"  # the trainer's shared-memory file is not visible to the reader
DEVICE_UUID_MISMATCH = "DeviceUUIDMismatch"  # no GPU of the reader's container has the trainer's UUID
OPEN_MEM_HANDLE_FAILED = "OpenMemHandleFailed"  # opening the exported memory raised
PATTERN_MISMATCH = "PatternMismatch"  # opened, but the bytes differ from what the trainer wrote
PID_NAMESPACE_NOT_SHARED = "PIDNamespaceNotShared"  # the reader cannot see the trainer's process
PEER_TIMEOUT = "PeerTimeout"  # no answer within the preflight timeout
PREFLIGHT_FAILURES = (
    SHM_NOT_SHARED,
    DEVICE_UUID_MISMATCH,
    OPEN_MEM_HANDLE_FAILED,
    PATTERN_MISMATCH,
    PID_NAMESPACE_NOT_SHARED,
    PEER_TIMEOUT,
)
PREFLIGHT_REASONS = (PREFLIGHT_PASSED, *PREFLIGHT_FAILURES)


class EventError(ValueError):
    """A stream entry that does not decode as a step event."""


# The stream fields of a rollout record (module docstring), in RolloutFigures' order.
ROLLOUT_FIELDS = ("kl", "logp_diff_mean", "logp_diff_max", "logp_over", "logp_threshold", "tokens")


@dataclass(frozen=True, slots=True)
class RolloutFigures:
    """One step's log-prob agreement between the engine that sampled and the trainer (computed by
    runtime/consistency.py): K3 KL, |delta logp| mean and max, the fraction of tokens over `threshold`, and
    the tokens compared."""

    kl: float
    diff_mean: float
    diff_max: float
    over_fraction: float
    threshold: float
    tokens: int

    def __post_init__(self) -> None:
        for name in ("kl", "diff_mean", "diff_max", "threshold"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise EventError(f"rollout {name} {_short(value)} is not a finite number >= 0")
        if not (0.0 <= self.over_fraction <= 1.0):
            raise EventError(f"rollout over_fraction {_short(self.over_fraction)} is not in [0, 1]")
        if not 0 <= self.tokens < NUMBER_MAX:
            raise EventError(f"rollout tokens {_short(self.tokens)} is not a count in [0, 2**62)")

    def fields(self) -> dict[str, str]:
        values = (self.kl, self.diff_mean, self.diff_max, self.over_fraction, self.threshold)
        return {
            **{key: repr(float(v)) for key, v in zip(ROLLOUT_FIELDS, values, strict=False)},
            "tokens": str(self.tokens),
        }

    @classmethod
    def of_fields(cls, f: Mapping[str, str]) -> RolloutFigures:
        kl, mean, most, over, threshold = (_finite(f[key]) for key in ROLLOUT_FIELDS[:5])
        return cls(kl, mean, most, over, threshold, _count(f["tokens"]))


# The trainer's final record also goes to its container's termination message, which Kubernetes keeps in the
# pod's status: the operator's authoritative source when the stream lost it (a Redis restart) before any
# follower read it. The file exists in every Kubernetes container; elsewhere nothing is written.
TERMINATION_LOG = "/dev/termination-log"
FINAL_MESSAGE_KEY = "colocateFinal"


def final_termination_message(step: int) -> str:
    return json.dumps({FINAL_MESSAGE_KEY: "ok", "step": step})


def is_final_termination_message(text: str | None) -> bool:
    """True for what `final_termination_message` wrote (anything else in a termination message: False)."""
    if not text or FINAL_MESSAGE_KEY not in text or len(text) > 4096:
        return False
    try:
        parsed = json.loads(text)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get(FINAL_MESSAGE_KEY) == "ok"


def stream_key(namespace: str, job: str) -> str:
    return f"{job_prefix(namespace, job)}:events"


def is_detail(event: StepEvent) -> bool:
    """Per-GPU progress within a step, which summary mode writes for one process only (module docstring)."""
    return event.phase in DETAIL_PHASES or (event.role == "reader" and event.phase == "finished")


def is_summarized(event: StepEvent) -> bool:
    """A GPU's successful finish, which summary mode folds into the step's one `completed` record."""
    return event.role == "trainer" and event.phase == "finished" and event.result == "ok"


@dataclass(frozen=True, slots=True)
class StepEvent:
    role: str
    gen: int
    step: int
    phase: str
    result: str = ""
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    handles: int = 0
    replica: int = 0
    rank: int = 0
    gpu: str = ""
    weight_version: str = ""
    final: bool = False
    error: str = ""
    ts: float = 0.0
    reason: str = ""  # preflight events only (PREFLIGHT_REASONS)
    rollout: RolloutFigures | None = None  # rollout events only, and always on them

    def __post_init__(self) -> None:
        if self.role not in ("trainer", "reader"):
            raise EventError(f"role {self.role!r} is not trainer or reader")
        if self.phase not in PHASES:
            raise EventError(f"phase {self.phase!r} is not one of {PHASES}")
        if self.result not in RESULTS:
            raise EventError(f"result {self.result!r} is not one of {RESULTS}")
        if self.reason and self.reason not in PREFLIGHT_REASONS:
            raise EventError(f"reason {self.reason!r} is not one of {PREFLIGHT_REASONS}")
        if (self.rollout is None) == (self.phase == "rollout"):
            raise EventError("a rollout event carries its figures (kl, logp_diff_*, tokens); no other does")


@dataclass(frozen=True, slots=True)
class EventSource:
    """The process writing events (its role, pod, rank and GPU, the same on each of them): the one place
    events are made, so every writer fills the identity fields alike."""

    role: str
    replica: int = 0
    rank: int = 0
    gpu: str = ""

    def event(
        self,
        gen: int,
        step: int,
        phase: str,
        *,
        result: str = "",
        seconds: float = 0.0,
        phase_seconds: Mapping[str, float] | None = None,
        nbytes: int = 0,
        handles: int = 0,
        weight_version: str = "",
        final: bool = False,
        error: str = "",
        reason: str = "",
        rollout: RolloutFigures | None = None,
    ) -> StepEvent:
        return StepEvent(
            role=self.role,
            gen=gen,
            step=step,
            phase=phase,
            result=result,
            seconds=seconds,
            phase_seconds=dict(phase_seconds or {}),
            bytes=nbytes,
            handles=handles,
            replica=self.replica,
            rank=self.rank,
            gpu=self.gpu,
            weight_version=weight_version,
            final=final,
            error=error,
            reason=reason,
            rollout=rollout,
        )

    def rollout(self, gen: int, step: int, figures: RolloutFigures) -> StepEvent:
        """One step's log-prob agreement record (module docstring)."""
        return self.event(gen, step, "rollout", result="ok", rollout=figures)

    def preflight(
        self,
        gen: int,
        *,
        nbytes: int,
        seconds: float = 0.0,
        result: str = "",
        reason: str = "",
        error: str = "",
    ) -> StepEvent:
        """A preflight record: step 0 of incarnation `gen`, one buffer of `nbytes` (the module docstring)."""
        return self.event(
            gen,
            0,
            "preflight",
            result=result,
            seconds=seconds,
            nbytes=nbytes,
            handles=1,
            reason=reason,
            error=error,
        )


def encode(event: StepEvent, *, now: float | None = None) -> dict[str, str]:
    """Stream fields of an event; `ts` is set from `now` (or the clock) when the event has none."""
    ts = event.ts or (time.time() if now is None else now)
    fields = {
        "v": str(SCHEMA_VERSION),
        "role": event.role,
        "gen": str(event.gen),
        "step": str(event.step),
        "phase": event.phase,
        "result": event.result,
        "seconds": f"{event.seconds:.6f}",
        "phase_seconds": json.dumps(
            {k: round(v, 6) for k, v in sorted(event.phase_seconds.items())}, separators=(",", ":")
        ),
        "bytes": str(event.bytes),
        "handles": str(event.handles),
        "replica": str(event.replica),
        "rank": str(event.rank),
        "gpu": event.gpu,
        "weight_version": event.weight_version,
        "final": "true" if event.final else "false",
        "error": event.error[:ERROR_MAX_CHARS],
        "ts": f"{ts:.6f}",
    }
    if event.reason:  # optional: entries without it stay byte-for-byte what older writers produced
        fields["reason"] = event.reason
    if event.rollout is not None:
        fields.update(event.rollout.fields())
    return fields


_SCHEMA_TEXT = str(SCHEMA_VERSION)


def decode(fields: Mapping[Any, Any] | Sequence[Any]) -> StepEvent:
    """The event of one stream entry: a mapping of its fields, or their flat list `[key, value, ...]` as the
    server sends it (the operator reads raw replies, without a dict per entry). Keys and values may be
    bytes.

    Anything an entry can hold (bad bytes, oversized fields, huge or non-finite numbers) raises EventError
    with a bounded message, never another exception."""
    if type(fields) is list:  # a raw reply's entry: most are exactly what `encode` writes
        event = _decode_written(fields)
        if event is not None:
            return event
    return _decode_checked(fields)


def _decode_checked(fields: Mapping[Any, Any] | Sequence[Any]) -> StepEvent:
    """`decode` for any entry, field by field: the reference the fast path is held to, and what words the
    error of an entry that does not decode."""
    try:
        flat = not isinstance(fields, Mapping)
        count = len(fields) // 2 if flat else len(fields)
        if count > ENTRY_MAX_FIELDS:
            raise EventError(f"entry has {count} fields, at most {ENTRY_MAX_FIELDS}")
        if flat and len(fields) % 2:
            raise EventError(f"entry has a key without its value ({len(fields)} keys and values)")
        pairs: Iterable[tuple[Any, Any]] = (
            zip(fields[::2], fields[1::2], strict=True) if flat else fields.items()  # type: ignore[union-attr]
        )
        f: dict[str, str] = {}
        for k, v in pairs:
            if len(k) > FIELD_MAX_BYTES or len(v) > FIELD_MAX_BYTES:
                raise EventError(f"field {_short(k)!r} is longer than {FIELD_MAX_BYTES} bytes")
            f[k.decode() if isinstance(k, bytes) else str(k)] = v.decode() if isinstance(v, bytes) else str(v)
        if f.get("v") != _SCHEMA_TEXT:
            raise EventError(f"event schema {_short(f.get('v'))!r}, this reader knows {SCHEMA_VERSION}")
        if len(f.get("gpu", "")) > NAME_MAX_CHARS or len(f.get("weight_version", "")) > NAME_MAX_CHARS:
            name = "gpu" if len(f.get("gpu", "")) > NAME_MAX_CHARS else "weight_version"
            raise EventError(f"{name} is longer than {NAME_MAX_CHARS} characters")
        phase_seconds = _phase_seconds(f.get("phase_seconds") or "{}")
        return StepEvent(
            role=f["role"],
            gen=_count(f["gen"]),
            step=_count(f["step"]),
            phase=f["phase"],
            result=f.get("result", ""),
            seconds=_finite(f.get("seconds") or "0"),
            phase_seconds=phase_seconds,
            bytes=_count(f.get("bytes") or "0"),
            handles=_count(f.get("handles") or "0"),
            replica=_count(f.get("replica") or "0"),
            rank=_count(f.get("rank") or "0"),
            gpu=f.get("gpu", ""),
            weight_version=f.get("weight_version", ""),
            final=f.get("final") == "true",
            error=f.get("error", "")[:ERROR_MAX_CHARS],
            ts=_finite(f.get("ts") or "0"),
            reason=f.get("reason", ""),
            rollout=RolloutFigures.of_fields(f) if "kl" in f else None,
        )
    except EventError:
        raise
    except (KeyError, ValueError, TypeError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise EventError(f"malformed step event: {type(err).__name__}: {_short(err)}") from None


# The fast path (issue 35: at 1000 jobs a step a second the operator decodes 32,000 entries a second, and the
# field-by-field path took about 17 us an entry, a third of it building the frozen dataclass). It reads an
# entry whose keys are exactly what `encode` writes, in its order (redis-py's XADD keeps a dict's order), by
# position; anything else, and anything out of bounds, goes to `_decode_checked`, which decides and words
# the error. It accepts nothing the checked path refuses and builds an equal event
# (tests/runtime/test_events_fast.py holds the two to that).
_WRITTEN_KEYS = [
    "v",
    "role",
    "gen",
    "step",
    "phase",
    "result",
    "seconds",
    "phase_seconds",
    "bytes",
    "handles",
    "replica",
    "rank",
    "gpu",
    "weight_version",
    "final",
    "error",
    "ts",
]
_WRITTEN_WITH_REASON = [*_WRITTEN_KEYS, "reason"]
_ROLES = frozenset(("trainer", "reader"))
_PHASES = frozenset(PHASES) - {"rollout"}  # a rollout record carries more keys: the checked path reads it
_RESULTS = frozenset(RESULTS)
_REASONS = frozenset(("", *PREFLIGHT_REASONS))
_UNCHECKED = (EventError, KeyError, ValueError, TypeError, AttributeError, RecursionError)


class _Filled:
    """StepEvent's slot layout without its checks: the fast path fills one and makes it a StepEvent (a frozen
    dataclass's __init__ sets each field through object.__setattr__: 18 calls, 5 us an event)."""

    __slots__ = StepEvent.__slots__

    def __init__(self, *values: Any) -> None:
        (
            self.role,
            self.gen,
            self.step,
            self.phase,
            self.result,
            self.seconds,
            self.phase_seconds,
            self.bytes,
            self.handles,
            self.replica,
            self.rank,
            self.gpu,
            self.weight_version,
            self.final,
            self.error,
            self.ts,
            self.reason,
            self.rollout,
        ) = values


def decode_joined(joined: bytes) -> StepEvent:
    """`decode` of an entry whose keys and values come joined by NUL bytes, none of them holding one (the
    operator's bounded read joins them in Redis: one string to parse, not 34)."""
    if joined.isascii():  # then a character is a byte, and the bound on a field holds for its text
        text = joined.decode().split("\0")
        if len(joined) <= FIELD_MAX_BYTES or max(map(len, text)) <= FIELD_MAX_BYTES:
            event = _decode_text(text)
            if event is not None:
                return event
    return _decode_checked(joined.split(b"\0"))


def _decode_written(fields: list[Any]) -> StepEvent | None:
    """The fast path on a flat list of bytes (`_decode_text`); None where it does not apply."""
    try:
        text = list(map(bytes.decode, fields))  # bytes only, and UTF-8 (the checked path decodes all too)
        if max(map(len, fields)) > FIELD_MAX_BYTES:
            return None
    except (TypeError, ValueError):
        return None
    return _decode_text(text)


def _decode_text(text: list[str]) -> StepEvent | None:
    """The event of an entry exactly as `encode` writes it, its keys and values decoded (each at most
    FIELD_MAX_BYTES as bytes), checked as `_decode_checked` checks it; None for any other entry, or one that
    does not pass."""
    try:
        keys = text[::2]
        if (keys != _WRITTEN_KEYS and keys != _WRITTEN_WITH_REASON) or len(text) & 1:
            return None
        (v, role, gen, step, phase, result, secs, phases, nbytes, handles, replica, rank) = text[1:24:2]
        (gpu, version, final, error, ts) = text[25:34:2]
        why = text[35] if len(text) == 36 else ""
        if (
            v != _SCHEMA_TEXT
            or role not in _ROLES
            or phase not in _PHASES
            or result not in _RESULTS
            or why not in _REASONS
            or len(gpu) > NAME_MAX_CHARS
            or len(version) > NAME_MAX_CHARS
        ):
            return None
        counts = (
            int(gen),
            int(step),
            int(nbytes or "0"),
            int(handles or "0"),
            int(replica or "0"),
            int(rank or "0"),
        )
        if min(counts) < 0 or max(counts) >= NUMBER_MAX:
            return None
        seconds, at = float(secs or "0"), float(ts or "0")
        if not (math.isfinite(seconds) and math.isfinite(at)):
            return None
        event = _Filled(
            role,
            counts[0],
            counts[1],
            phase,
            result,
            seconds,
            {} if phases == "{}" or not phases else _phase_seconds(phases),
            *counts[2:],
            gpu,
            version,
            final == "true",
            error[:ERROR_MAX_CHARS],
            at,
            why,
            None,
        )
    except _UNCHECKED:
        return None
    event.__class__ = StepEvent  # type: ignore[assignment]  # the same slots: a StepEvent from here on
    return event  # type: ignore[return-value]


def _phase_seconds(raw: str) -> dict[str, float]:
    """The `phase_seconds` field: a JSON object of at most PHASE_SECONDS_MAX phases, names cut to 32."""
    phase_seconds = {} if raw == "{}" else json.loads(raw)
    if not isinstance(phase_seconds, dict) or len(phase_seconds) > PHASE_SECONDS_MAX:
        raise EventError(f"phase_seconds is not a JSON object of at most {PHASE_SECONDS_MAX} phases")
    return {str(k)[:32]: _finite(v) for k, v in phase_seconds.items()} if phase_seconds else {}


def decode_entries(entries: list[tuple[Any, dict[Any, Any]]]) -> list[tuple[str, StepEvent]]:
    """`[(entry_id, event)]` from an `XRANGE` reply or one stream of an `XREAD` reply."""
    return [(_text(entry_id), decode(fields)) for entry_id, fields in entries]


class _XAdd(Protocol):
    def xadd(self, name: str, fields: dict[str, str], *, maxlen: int, approximate: bool) -> Any: ...


def xadd(client: _XAdd, key: str, event: StepEvent, *, maxlen: int = STREAM_MAXLEN) -> Any:
    """Append one event (works with a redis-py client or pipeline)."""
    return client.xadd(key, encode(event), maxlen=maxlen, approximate=True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _short(value: Any, limit: int = 80) -> str:
    """Text of an untrusted value cut for an error message (bad bytes shown escaped)."""
    text = value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _count(text: str) -> int:
    value = int(text)
    if not 0 <= value < NUMBER_MAX:
        raise EventError(f"{_short(text)} is not a count in [0, 2**62)")
    return value


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise EventError(f"{_short(value)} is not a finite number")
    return number
