"""Trainer side of the IPC preflight (the protocol is in preflight.py): offer a pattern buffer on this GPU,
wait for the reader side's verdict, free only when that is safe, and report each attempt as an event."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from colocate_runtime.colocated.liveness import host_id, process_gone
from colocate_runtime.colocated.metastore import (
    CLAIM_REVOKED,
    MetaStore,
    MetaStoreError,
    MetaStoreUnavailable,
)
from colocate_runtime.colocated.preflight import (
    Offer,
    OfferError,
    PreflightFailed,
    PreflightSettings,
    Verdict,
    encode_offer,
    event_fields,
    pattern,
    remove_probe,
    write_probe,
)
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.colocated.waits import Deadline
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.events import EventSource, StepEvent

log = logging.getLogger(__name__)

GRACE_S = 10.0  # after the timeout, how long a reader that already claimed the attempt gets for its verdict


@dataclass(slots=True)
class _Parked:
    """A preflight buffer a reader may still map: freed once it answered or is known dead."""

    gen: int
    attempt: int
    bucket: LocalBucket
    claimant: str | None


class TrainerPreflight:
    """Runs the preflight of one trainer GPU. `emit` records an event (it must not raise)."""

    def __init__(
        self,
        store: MetaStore,
        exporter: BucketExporter,
        settings: PreflightSettings,
        *,
        replica: int,
        rank: int,
        emit: Callable[[StepEvent], None],
    ) -> None:
        self.store = store
        self.exporter = exporter
        self.settings = settings
        self.replica = replica
        self.rank = rank
        self.uuid = exporter.device_uuid()
        self.source = EventSource("trainer", replica, rank, self.uuid)
        self._emit = emit
        self._attempt = 0  # attempt numbers never repeat within a process (offers are NX)
        self._parked: list[_Parked] = []

    @property
    def parked(self) -> int:
        return len(self._parked)

    def run(self, gen: int) -> Verdict:
        """Attempt until one passes (Wait) or one fails (Fail); raises PreflightFailed."""
        mode = self.settings.mode
        wait = Deadline(self.settings.wait_s) if self.settings.wait_s > 0 else None
        attempts = 0
        reported: str | None = None
        while True:
            attempts += 1
            started = time.monotonic()
            try:
                verdict = self.attempt(gen)
            except MetaStoreUnavailable as err:
                if mode == "Fail":
                    raise
                verdict = None
                log.warning("IPC preflight on %s: %s; retrying", self.uuid, err)
            if verdict is not None and verdict.ok:
                log.info("IPC preflight on %s passed (generation %d, attempt %d)", self.uuid, gen, attempts)
                return verdict
            if verdict is not None and mode == "Fail":
                raise PreflightFailed(self.uuid, verdict.reason, verdict.message, attempts=attempts)
            if wait is not None and wait.expired:
                reason = verdict.reason if verdict is not None else ev.PEER_TIMEOUT
                detail = verdict.message if verdict is not None else "meta-store unreachable"
                raise PreflightFailed(
                    self.uuid,
                    reason,
                    f"{detail}; gave up after {self.settings.wait_s:.0f} s",
                    attempts=attempts,
                )
            if verdict is not None and (verdict.reason != reported or attempts % 10 == 0):
                reported = verdict.reason
                log.warning(
                    "IPC preflight on %s failed (%s): %s; waiting, attempt %d",
                    self.uuid,
                    verdict.reason,
                    verdict.message,
                    attempts,
                )
            # A fast failure is retried at most every retry_s; a PeerTimeout has waited already.
            pause = Deadline(max(0.0, self.settings.retry_s - (time.monotonic() - started)))
            while not pause.expired and not (wait is not None and wait.expired):
                time.sleep(pause.slice())

    def attempt(self, gen: int) -> Verdict:
        """One attempt, bounded by the timeout (plus a short grace when a reader claimed it late)."""
        self.reap()
        self._attempt += 1
        n = self._attempt
        t0 = time.perf_counter()
        nbytes = self.settings.nbytes
        seed, token = secrets.randbits(31), secrets.token_hex(8)
        probe = f"{self.settings.probe_prefix}g{gen}-a{n}-{os.getpid()}-{token[:8]}"
        self._event(gen, result="")
        bucket: LocalBucket | None = None
        try:
            write_probe(self.settings.shm_dir, probe, token)
            bucket = self.exporter.allocate(0, nbytes, f"g{gen}-pf{n}")
            assert bucket.tensor is not None
            bucket.tensor.copy_(pattern(nbytes, seed))
            self.exporter.export(bucket)
            self.exporter.synchronize()
            offer = Offer(
                gen=gen,
                attempt=n,
                gpu=self.uuid,
                transport=self.exporter.kind,
                replica=self.replica,
                rank=self.rank,
                pid=os.getpid(),
                host=host_id(),
                nbytes=nbytes,
                seed=seed,
                token=token,
                probe=probe,
                descriptor=dict(bucket.descriptor or {}),
            )
            self.store.offer_preflight(gen, n, self.uuid, self.replica, encode_offer(offer))
        except BaseException:
            # Not announced (or the announcement failed): nobody can map it.
            if bucket is not None:
                self.exporter.free([bucket])
            remove_probe(self.settings.shm_dir, probe)
            raise
        try:
            verdict = self._await(gen, n, Deadline(self.settings.timeout_s))
            if verdict is None:
                verdict = self._give_up(gen, n, bucket)
            else:
                self._release(gen, n, bucket, verdict, _claimant_of(verdict))
        finally:
            remove_probe(self.settings.shm_dir, probe)
        self._event(gen, verdict=verdict, seconds=time.perf_counter() - t0)
        return verdict

    # --- waiting and freeing ------------------------------------------------------------------------------

    def _await(self, gen: int, n: int, deadline: Deadline) -> Verdict | None:
        while True:
            try:
                raw = self.store.wait_preflight_result(gen, n, self.uuid, deadline.slice())
                if raw is not None:
                    return _decode_verdict(raw)
            except MetaStoreUnavailable:
                time.sleep(min(0.2, deadline.remaining()))
            if deadline.expired:
                return None

    def _give_up(self, gen: int, n: int, bucket: LocalBucket) -> Verdict:
        timeout = self.settings.timeout_s
        try:
            winner: str | None = self.store.claim_preflight(gen, n, self.uuid, CLAIM_REVOKED)
        except MetaStoreError:
            winner = None
        if winner == CLAIM_REVOKED:
            self.exporter.release([bucket])  # no reader will map it: torch's share count is ours to drop
            self.exporter.free([bucket])
            return Verdict(
                False,
                ev.PEER_TIMEOUT,
                f"nothing on the SGLang side answered within {timeout:.0f} s (no reader claimed the buffer)",
            )
        # A reader claimed it (or Redis did not say): it may be mapping the buffer right now.
        verdict = self._await(gen, n, Deadline(min(GRACE_S, timeout)))
        if verdict is not None:
            self._release(gen, n, bucket, verdict, winner)
            return verdict
        self._release(gen, n, bucket, None, winner)
        who = _claimant_text(winner)
        return Verdict(
            False, ev.PEER_TIMEOUT, f"{who} claimed the buffer but gave no verdict within {timeout:.0f} s"
        )

    def _release(
        self, gen: int, n: int, bucket: LocalBucket, verdict: Verdict | None, claimant: str | None
    ) -> None:
        if (verdict is not None and verdict.ipc_closed) or _claimant_dead(claimant):
            self._free(bucket, verdict, claimant)
            return
        self._parked.append(_Parked(gen, n, bucket, claimant))
        log.warning(
            "IPC preflight on %s: buffer of attempt %d kept until its reader answers or dies", self.uuid, n
        )

    def _free(self, bucket: LocalBucket, verdict: Verdict | None, claimant: str | None) -> None:
        """Free a buffer nobody maps any more; first drop the share a reader never took (it did not open the
        buffer) or took and died with, or torch keeps the memory until this process exits."""
        if _claimant_dead(claimant) or (verdict is not None and verdict.opened is False):
            self.exporter.release([bucket])
        self.exporter.free([bucket])

    def reap(self) -> None:
        """Free kept buffers whose reader has answered since, or died."""
        still = []
        for p in self._parked:
            try:
                raw = self.store.read_preflight_result(p.gen, p.attempt, self.uuid)
                verdict = None if raw is None else _decode_verdict(raw)
            except MetaStoreError:
                verdict = None
            if (verdict is not None and verdict.ipc_closed) or _claimant_dead(p.claimant):
                self._free(p.bucket, verdict, p.claimant)
            else:
                still.append(p)
        self._parked = still

    # --- events -------------------------------------------------------------------------------------------

    def _event(
        self, gen: int, *, result: str = "", verdict: Verdict | None = None, seconds: float = 0.0
    ) -> None:
        fields = event_fields(verdict) if verdict is not None else {"result": result}
        self._emit(self.source.preflight(gen, nbytes=self.settings.nbytes, seconds=seconds, **fields))


def _decode_verdict(raw: bytes) -> Verdict:
    try:
        return Verdict.from_json(raw)
    except OfferError as err:
        # Nothing says the reader closed its mapping: keep the buffer (ipc_closed=False).
        return Verdict(False, ev.OPEN_MEM_HANDLE_FAILED, f"unreadable verdict: {err}", ipc_closed=False)


def _claimant_of(verdict: Verdict) -> str:
    return json.dumps({"pid": verdict.reader_pid, "host": verdict.reader_host})


def _claimant_text(claimant: str | None) -> str:
    try:
        d = json.loads(claimant or "")
        return f"the reader (pid {d['pid']} on {d['host']})"
    except (ValueError, KeyError, TypeError):
        return "a reader"


def _claimant_dead(claimant: str | None) -> bool:
    """Known dead: it ran on this host (the pod's containers share the hostname) and its process is gone."""
    try:
        d = json.loads(claimant or "")
        return d["host"] == host_id() and process_gone(int(d["pid"]))
    except (ValueError, KeyError, TypeError):
        return False
