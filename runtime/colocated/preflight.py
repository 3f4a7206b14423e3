"""IPC preflight: before its first step, each trainer process proves on its GPU that the SGLang side of its
pod can open what the trainer exports. Without it, a pod whose containers see different GPUs, or do not share
/dev/shm or the PID namespace, hangs (or fails obscurely) at its first weight sync.

One attempt per trainer GPU (keys in keys.py, events in contract/events.py; the two sides are
preflight_trainer.py and preflight_reader.py):

1. Trainer: a small pattern buffer (1 MiB) through the same exporter as real steps, a probe file in the
   shared-memory directory, and the offer (msgpack, `NX`, TTL) under its generation and attempt number,
   named in its pod's preflight index; an event `phase=preflight` with an empty result.
2. Reader side (a responder thread in the SGLang process) finds the offer in its pod's index. An offer for a
   GPU this container cannot see is answered `DeviceUUIDMismatch`. On its own GPU it claims the attempt,
   checks the probe (`ShmNotShared`) and that it sees the trainer's process (`PIDNamespaceNotShared`), opens
   the buffer with the same importer as real steps (`DeviceUUIDMismatch`, `ShmNotShared`,
   `OpenMemHandleFailed`), compares the pattern (`PatternMismatch`), closes verifiably (close.py) and writes
   its verdict (JSON, `NX`) stating `ipc_closed`, then its own event.
3. Trainer: frees the buffer after the verdict, at once when it revoked the claim of an unanswered attempt,
   or once the claimant is known dead; otherwise it keeps it (one small buffer leaked, never one freed under
   a live mapping). No verdict within the timeout is `PeerTimeout`. Then an event with the reason.

Modes (`COLOCATE_IPC_PREFLIGHT`): `Wait` retries (each attempt bounded, every wait wakes each second) until
an attempt passes or the optional wait deadline passes, reporting every failed attempt; `Fail` raises
`PreflightFailed` at the first failure; `Off` skips it. The writer publishes no step on a GPU before its
preflight passed.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.manifest import Descriptor
from colocate_runtime.contract import events as ev

SCHEMA_VERSION = 1
DEFAULT_NBYTES = 1 << 20
MAX_NBYTES = 64 << 20
MODES = ("Wait", "Fail", "Off")

# What to fix, per failure: the preflight's error says it, not only the reason.
HINTS = {
    ev.SHM_NOT_SHARED: "mount one memory-backed /dev/shm (emptyDir, medium Memory) in both containers",
    ev.DEVICE_UUID_MISMATCH: "both containers must see the same GPUs (one DRA claim, or the same devices)",
    ev.OPEN_MEM_HANDLE_FAILED: (
        "CUDA IPC needs both processes on the same GPU, a shared PID namespace and plain cudaMalloc memory"
    ),
    ev.PATTERN_MISMATCH: "the memory opened is not the memory exported (a driver or transport bug)",
    ev.PID_NAMESPACE_NOT_SHARED: "set shareProcessNamespace: true on the pod",
    ev.PEER_TIMEOUT: (
        "no SGLang worker answered: is colocate-operator[runtime] installed in the SGLang image (its plugin "
        "starts the workers on SGLang >= 0.5.11), and did the trainer call ColocatedRollout.start() before "
        "starting its writer (the init call, needed on 0.5.10)?"
    ),
}


class OfferError(ValueError):
    """A preflight offer or verdict that does not decode or does not match its key."""


class PreflightFailed(RuntimeError):
    """The preflight failed (Fail mode), or Wait mode's deadline passed; `reason` is one of
    events.PREFLIGHT_FAILURES."""

    def __init__(self, gpu: str, reason: str, message: str, *, attempts: int = 1) -> None:
        hint = HINTS.get(reason, "")
        super().__init__(
            f"IPC preflight on {gpu} failed ({reason}) after {attempts} attempt(s): {message}"
            + (f"; {hint}" if hint else "")
        )
        self.gpu = gpu
        self.reason = reason
        self.message = message
        self.attempts = attempts


@dataclass(frozen=True, slots=True)
class PreflightSettings:
    mode: str = "Off"
    timeout_s: float = 60.0  # one attempt
    wait_s: float = 900.0  # Wait mode: give up after this long; 0 waits forever
    retry_s: float = 5.0  # at most this often an attempt (a PeerTimeout attempt retries at once)
    nbytes: int = DEFAULT_NBYTES
    shm_dir: str = "/dev/shm"  # where the probe file goes: the directory both containers must share
    prefix: str = "colocate"  # probe file names start with `{prefix}-preflight-`

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"preflight mode {self.mode!r} is not one of {MODES}")
        if self.timeout_s <= 0 or not 0 < self.nbytes <= MAX_NBYTES:
            raise ValueError("preflight timeout must be positive and its buffer at most 64 MiB")

    @property
    def enabled(self) -> bool:
        return self.mode != "Off"

    @property
    def probe_prefix(self) -> str:
        return f"{self.prefix}-preflight-"

    @staticmethod
    def from_config(cfg: ColocateConfig) -> PreflightSettings:
        return PreflightSettings(
            mode=cfg.ipc_preflight,
            timeout_s=cfg.ipc_preflight_timeout_s,
            wait_s=cfg.ipc_preflight_wait_s,
            retry_s=min(5.0, cfg.ipc_preflight_timeout_s),
            shm_dir=cfg.shm_dir,
            prefix=f"colocate-{cfg.job}",
        )


@dataclass(frozen=True, slots=True)
class Offer:
    """What the trainer exported for one attempt: the reader side checks all of it before it maps anything."""

    gen: int
    attempt: int
    gpu: str
    transport: str
    replica: int
    rank: int
    pid: int
    host: str
    nbytes: int
    seed: int
    token: str
    probe: str  # file name in the trainer's shared-memory directory, holding `token`
    descriptor: Descriptor


def encode_offer(o: Offer) -> bytes:
    return msgpack.packb(
        {
            "schema": SCHEMA_VERSION,
            "gen": o.gen,
            "attempt": o.attempt,
            "gpu": o.gpu,
            "transport": o.transport,
            "replica": o.replica,
            "rank": o.rank,
            "pid": o.pid,
            "host": o.host,
            "nbytes": o.nbytes,
            "seed": o.seed,
            "token": o.token,
            "probe": o.probe,
            "descriptor": dict(o.descriptor),
        },
        use_bin_type=True,
    )


def decode_offer(blob: bytes, *, gen: int, attempt: int, gpu: str) -> Offer:
    """Decode and check an offer found under the key of (`gen`, `attempt`, `gpu`)."""
    try:
        d = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise OfferError(f"preflight offer is not valid msgpack: {err}") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA_VERSION:
        raise OfferError(f"preflight offer schema {d.get('schema') if isinstance(d, dict) else d!r} unknown")
    ints = ("gen", "attempt", "replica", "rank", "pid", "nbytes", "seed")
    texts = ("gpu", "transport", "host", "token", "probe")
    if not all(type(d.get(k)) is int for k in ints) or not all(isinstance(d.get(k), str) for k in texts):
        raise OfferError(f"preflight offer fields have the wrong types: {sorted(d)}")
    descriptor = d.get("descriptor")
    plain = (str, int, bytes, bool, type(None))
    if not isinstance(descriptor, dict) or not all(
        isinstance(k, str) and isinstance(v, plain) for k, v in descriptor.items()
    ):
        raise OfferError("preflight offer descriptor is not a map of plain fields")
    offer = Offer(**{k: d[k] for k in (*ints, *texts)}, descriptor=descriptor)
    if (offer.gen, offer.attempt, offer.gpu) != (gen, attempt, gpu):
        raise OfferError(
            f"preflight offer for {(offer.gen, offer.attempt, offer.gpu)} found under the key of "
            f"{(gen, attempt, gpu)}"
        )
    if not 0 < offer.nbytes <= MAX_NBYTES:
        raise OfferError(f"preflight buffer of {offer.nbytes} bytes")
    return offer


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one attempt: the reader side's answer, or the trainer's own (PeerTimeout)."""

    ok: bool
    reason: str  # events.PREFLIGHT_REASONS
    message: str = ""
    ipc_closed: bool = True  # the reader holds no mapping any more: the trainer may free
    reader_pid: int = 0
    reader_host: str = ""
    reader_gpu: str = ""  # the GPU (UUID) the answering process serves
    seconds: float = 0.0
    opened: bool | None = None  # whether the reader mapped the buffer (None: not said, assume it did)

    def __post_init__(self) -> None:
        if self.reason not in ev.PREFLIGHT_REASONS or self.ok != (self.reason == ev.PREFLIGHT_PASSED):
            raise OfferError(f"preflight verdict ok={self.ok} with reason {self.reason!r}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": SCHEMA_VERSION,
                "ok": self.ok,
                "reason": self.reason,
                "message": self.message[:1000],
                "ipc_closed": self.ipc_closed,
                "reader_pid": self.reader_pid,
                "reader_host": self.reader_host,
                "reader_gpu": self.reader_gpu,
                "seconds": round(self.seconds, 6),
                "opened": self.opened,
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str | bytes) -> Verdict:
        try:
            d = json.loads(text)
            if d.get("schema") != SCHEMA_VERSION:
                raise OfferError(f"preflight verdict schema {d.get('schema')!r} unknown")
            return Verdict(
                ok=d["ok"] is True,
                reason=str(d["reason"]),
                message=str(d.get("message", "")),
                ipc_closed=d.get("ipc_closed") is True,
                reader_pid=int(d.get("reader_pid", 0)),
                reader_host=str(d.get("reader_host", "")),
                reader_gpu=str(d.get("reader_gpu", "")),
                seconds=float(d.get("seconds", 0.0)),
                opened=d["opened"] if isinstance(d.get("opened"), bool) else None,
            )
        except OfferError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise OfferError(f"malformed preflight verdict: {err!r}") from None


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """The bytes an attempt writes (CPU, uint8): position- and seed-dependent, so a stale or shifted buffer
    never matches."""
    i = torch.arange(nbytes, dtype=torch.int64)
    return ((i * 167 + (i >> 8) * 13 + seed) % 251).to(torch.uint8)


def first_difference(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """Offset of the first differing byte, or None when equal (both CPU uint8 of one length)."""
    if torch.equal(got, want):
        return None
    return int(torch.nonzero(got != want)[0].item())


# --- the probe file: is the trainer's shared-memory directory the reader's? ---------------------------------


def write_probe(directory: str, name: str, token: str) -> None:
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)


def probe_visible(directory: str, name: str, token: str, prefix: str) -> bool:
    """The probe the trainer wrote, with its token, is in this process's shared-memory directory."""
    if "/" in name or not name.startswith(prefix):
        return False
    try:
        return (Path(directory) / name).read_bytes() == token.encode()
    except OSError:
        return False


def remove_probe(directory: str, name: str) -> None:
    with contextlib.suppress(OSError):
        (Path(directory) / name).unlink()


def event_fields(verdict: Verdict) -> dict[str, Any]:
    """The preflight event's result, reason and error for a verdict."""
    return {
        "result": "ok" if verdict.ok else "error",
        "reason": verdict.reason,
        "error": "" if verdict.ok else verdict.message,
    }
