"""Suspend at a step boundary: the meta-store records by which the operator asks the trainer to checkpoint
and the trainer answers (pure: key names and JSON codecs; the operator and colocated/checkpoint.py do I/O).

Keys, under the job's prefix `colocate:{namespace}:{job}` (`{p}`), none with a TTL (a suspension may last
days, and the records are a few hundred bytes):

| key | type | written by | content |
|---|---|---|---|
| `{p}:checkpoint:ranks` | hash | trainer, at start | rank -> JSON `{t, pid, host}`: it answers requests |
| `{p}:checkpoint:request` | string | operator, on suspend | JSON `{id, reason, t}`: checkpoint now |
| `{p}:checkpoint:acks` | hash | trainer, after its callback | rank -> JSON `{id, step}`: done after `step` |
| `{p}:checkpoint:resume` | string | trainer with its ACK; operator on resume | the step to resume after |

`t` is the meta-store's own clock (Redis TIME, seconds), read by each writer just before it writes: a trainer
honours only a request newer than its own registration, so a request left from an earlier suspension never
stops a freshly started trainer, whoever's clock is wrong. The operator waits for an ACK carrying the
request's `id` from every registered rank, or for the job's grace period to run out.

Every container of the job can write these keys, so readers treat them as untrusted: a value that does not
decode is ignored (`decode_*` raise CheckpointRecordError), never trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from colocate_runtime.contract.jobkeys import job_prefix

MAX_RECORD_BYTES = 4096
MAX_STEP = 2**62
MAX_ID_CHARS = 128
MAX_REASON_CHARS = 512


class CheckpointRecordError(ValueError):
    """A checkpoint record that does not decode (any container can write the meta-store)."""


@dataclass(frozen=True, slots=True)
class CheckpointKeys:
    namespace: str
    job: str

    @property
    def prefix(self) -> str:
        return f"{job_prefix(self.namespace, self.job)}:checkpoint"

    @property
    def ranks(self) -> str:
        return f"{self.prefix}:ranks"

    @property
    def request(self) -> str:
        return f"{self.prefix}:request"

    @property
    def acks(self) -> str:
        return f"{self.prefix}:acks"

    @property
    def resume(self) -> str:
        return f"{self.prefix}:resume"


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    id: str  # one per suspension (the operator uses the time the suspension began)
    reason: str
    t: float  # Redis TIME when written

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "reason": self.reason[:MAX_REASON_CHARS], "t": self.t})


@dataclass(frozen=True, slots=True)
class CheckpointAck:
    id: str  # the request answered
    step: int  # the last step whose weight sync finished before the checkpoint

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "step": self.step})


def _object(raw: bytes | str | None) -> dict[str, Any]:
    if raw is None:
        raise CheckpointRecordError("no record")
    if len(raw) > MAX_RECORD_BYTES:
        raise CheckpointRecordError(f"record of {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointRecordError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointRecordError("not a JSON object")
    return value


def _id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise CheckpointRecordError(f"id must be a string of 1..{MAX_ID_CHARS} characters")
    return value


def decode_step(raw: bytes | str | int | None) -> int:
    """A step number: an integer in [0, 2**62)."""
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", errors="replace")
    if isinstance(raw, str):
        if not raw.strip().isdigit():
            raise CheckpointRecordError(f"step {raw[:32]!r} is not a non-negative integer")
        raw = int(raw.strip())
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < MAX_STEP:
        raise CheckpointRecordError(f"step {raw!r} is not an integer in [0, 2**62)")
    return raw


def decode_request(raw: bytes | str | None) -> CheckpointRequest:
    d = _object(raw)
    t = d.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1e11:
        raise CheckpointRecordError("t must be a Unix time in seconds")
    reason = d.get("reason", "")
    if not isinstance(reason, str):
        raise CheckpointRecordError("reason must be a string")
    return CheckpointRequest(_id(d.get("id")), reason[:MAX_REASON_CHARS], float(t))


def decode_ack(raw: bytes | str | None) -> CheckpointAck:
    d = _object(raw)
    return CheckpointAck(_id(d.get("id")), decode_step(d.get("step")))


def decode_registration_time(raw: bytes | str | None) -> float:
    t = _object(raw).get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1e11:
        raise CheckpointRecordError("t must be a Unix time in seconds")
    return float(t)


def redis_time(reply: tuple[int, int] | list[Any]) -> float:
    """Redis TIME's reply (seconds, microseconds) as seconds."""
    seconds, micros = reply
    return int(seconds) + int(micros) / 1e6
