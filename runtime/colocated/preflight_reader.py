"""Reader side of the IPC preflight (the protocol is in preflight.py): a responder in the SGLang process that
answers the preflight offers of its pod's trainers.

It runs on its own daemon thread from process start (the trainer publishes no step before its preflight
passed, so the reader's first step cannot be what answers it), waking at least once a second. Each pass
reads the pod's preflight index: an offer on this process's GPU is opened, verified and closed with the
same importer and forced close as real steps; an offer for a GPU no GPU of this container has is answered
`DeviceUUIDMismatch`; offers on the container's other GPUs are left to the processes serving them.

The mismatch answer waits a short grace and claims the attempt first: a process that sees fewer GPUs than
its container (a narrowed CUDA_VISIBLE_DEVICES) must not pre-empt the process that serves the GPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import traceback
from collections import OrderedDict

import torch

from colocate_runtime.colocated.close import ImportScope
from colocate_runtime.colocated.liveness import host_id, process_gone
from colocate_runtime.colocated.metastore import MetaStore, MetaStoreError, MetaStoreUnavailable
from colocate_runtime.colocated.preflight import (
    Offer,
    OfferError,
    PreflightSettings,
    Verdict,
    decode_offer,
    event_fields,
    first_difference,
    pattern,
    probe_visible,
)
from colocate_runtime.colocated.transport import BucketGone, BucketImporter, DeviceNotVisible
from colocate_runtime.colocated.waits import WAKE_S, Deadline
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.events import EventSource

log = logging.getLogger(__name__)

_REMEMBERED = 256  # answered (gpu, gen, attempt) kept to skip them on later passes
MISMATCH_GRACE_S = 5.0  # an offer for an unseen GPU is answered only after this long (or a quarter timeout)


class PreflightResponder:
    """Answers preflight offers for `importer`'s GPU. `visible` lists every GPU UUID of this container; None
    where that cannot be told (the shared-memory path): then no offer is answered DeviceUUIDMismatch."""

    def __init__(
        self,
        store: MetaStore,
        importer: BucketImporter,
        settings: PreflightSettings,
        *,
        replica: int,
        rank: int = 0,
        visible: frozenset[str] | None = None,
    ) -> None:
        self.store = store
        self.importer = importer
        self.settings = settings
        self.replica = replica
        self.rank = rank
        self.visible = visible
        self.uuid = importer.device_uuid()
        self._me = json.dumps({"pid": os.getpid(), "host": host_id(), "gpu": self.uuid})
        self._done: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._foreign: dict[tuple[str, int, int], float] = {}  # unseen GPU's offer -> when first seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> PreflightResponder:
        self._thread = threading.Thread(target=self._run, name="colocate-preflight", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        self._thread = None

    def _run(self) -> None:
        device = getattr(self.importer, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        failures = 0
        while not self._stop.is_set():
            try:
                self.poll(WAKE_S)
                failures = 0
            except MetaStoreError as err:
                failures += 1
                if failures in (1, 10, 100) or failures % 1000 == 0:
                    log.warning(
                        "IPC preflight responder on %s (%d failures in a row): %s", self.uuid, failures, err
                    )
                self._stop.wait(WAKE_S)
            except Exception:  # the responder must outlive any surprise; the trainer then times out
                log.exception("IPC preflight responder on %s failed a pass", self.uuid)
                self._stop.wait(WAKE_S)

    # --- one pass -----------------------------------------------------------------------------------------

    def poll(self, timeout_s: float = WAKE_S) -> list[Verdict]:
        """Wait at most `timeout_s` for an offer on this GPU, then answer every new offer of the pod."""
        self.store.wait_preflight_offer(self.uuid, timeout_s)
        answered = []
        offers = self.store.preflight_offers(self.replica)
        self._foreign = {k: t for k, t in self._foreign.items() if offers.get(k[0]) == k[1:]}
        for gpu, (gen, attempt) in sorted(offers.items()):
            key = (gpu, gen, attempt)
            if key in self._done:
                continue
            if gpu != self.uuid and self.visible is not None and gpu not in self.visible:
                first = self._foreign.setdefault(key, time.monotonic())
                if time.monotonic() - first < min(MISMATCH_GRACE_S, self.settings.timeout_s / 4):
                    continue  # give the process serving that GPU, if any, time to claim it
            verdict = self._answer(gpu, gen, attempt)
            self._done[key] = None
            self._foreign.pop(key, None)
            while len(self._done) > _REMEMBERED:
                self._done.popitem(last=False)
            if verdict is not None:
                answered.append(verdict)
        return answered

    def _answer(self, gpu: str, gen: int, attempt: int) -> Verdict | None:
        if gpu != self.uuid and (self.visible is None or gpu in self.visible):
            return None  # a GPU of this container served by another process
        if self.store.read_preflight_result(gen, attempt, gpu) is not None:
            return None  # answered already
        blob = self.store.read_preflight_offer(gen, attempt, gpu)
        if blob is None:
            return None  # expired: its trainer is long gone
        current = self.store.current_gen(gpu)
        if current is not None and gen < current:
            return None  # an older incarnation's offer
        t0 = time.perf_counter()
        if self.store.claim_preflight(gen, attempt, gpu, self._me) != self._me:
            return None  # the trainer gave up on it first, or the process serving that GPU claimed it
        if gpu != self.uuid:
            verdict = self._verdict(
                False,
                ev.DEVICE_UUID_MISMATCH,
                f"the trainer's GPU {gpu} is not visible in the SGLang container "
                f"(it sees {sorted(self.visible or ())})",
                t0,
            )
            return self._report(gpu, gen, attempt, verdict, None)
        offer: Offer | None = None
        try:
            offer = decode_offer(blob, gen=gen, attempt=attempt, gpu=gpu)
            verdict = self._check(offer, t0)
        except OfferError as err:
            verdict = self._verdict(False, ev.OPEN_MEM_HANDLE_FAILED, f"preflight offer rejected: {err}", t0)
        return self._report(gpu, gen, attempt, verdict, offer)

    def _check(self, offer: Offer, t0: float) -> Verdict:
        if offer.transport != self.importer.kind:
            return self._verdict(
                False,
                ev.OPEN_MEM_HANDLE_FAILED,
                f"the trainer exports {offer.transport}, the SGLang side opens {self.importer.kind}",
                t0,
            )
        shm = self.settings.shm_dir
        if not probe_visible(shm, offer.probe, offer.token, self.settings.probe_prefix):
            return self._verdict(
                False,
                ev.SHM_NOT_SHARED,
                f"the trainer's probe file {offer.probe} is not in {shm} here: the trainer and SGLang "
                "containers do not share their shared-memory directory",
                t0,
            )
        if offer.host == host_id() and process_gone(offer.pid):
            return self._verdict(
                False,
                ev.PID_NAMESPACE_NOT_SHARED,
                f"the trainer's process {offer.pid} is not visible from the SGLang container",
                t0,
            )
        scope = ImportScope()
        try:
            verdict = self._open_and_compare(offer, scope, t0)
        finally:
            close = scope.close(self.importer.synchronize)
        # Whether the buffer was mapped: the trainer drops torch's share of one that was not.
        verdict = dataclasses.replace(verdict, opened=bool(close.opened))
        if not close.released:
            return self._verdict(
                False,
                ev.OPEN_MEM_HANDLE_FAILED,
                "the preflight mapping is still referenced after the forced close",
                t0,
                ipc_closed=False,
                opened=True,
            )
        return verdict

    def _open_and_compare(self, offer: Offer, scope: ImportScope, t0: float) -> Verdict:
        try:
            scope.add(0, self.importer.open(offer.descriptor, offer.nbytes))
        except DeviceNotVisible as err:
            return self._verdict(False, ev.DEVICE_UUID_MISMATCH, str(err), t0)
        except BucketGone as err:
            return self._verdict(False, ev.SHM_NOT_SHARED, str(err), t0)
        except Exception as err:  # the CUDA open (or the shared-memory map) raised
            traceback.clear_frames(err.__traceback__)
            return self._verdict(False, ev.OPEN_MEM_HANDLE_FAILED, f"{type(err).__name__}: {err}", t0)
        try:
            got = scope.bucket(0).to("cpu", copy=True)
            self.importer.synchronize()
        except Exception as err:
            traceback.clear_frames(err.__traceback__)  # its frames would keep the mapping alive
            return self._verdict(
                False, ev.OPEN_MEM_HANDLE_FAILED, f"reading it raised {type(err).__name__}: {err}", t0
            )
        at = first_difference(got, pattern(offer.nbytes, offer.seed))
        if at is not None:
            return self._verdict(
                False,
                ev.PATTERN_MISMATCH,
                f"byte {at} of the {offer.nbytes}-byte buffer differs from what the trainer wrote",
                t0,
            )
        return self._verdict(True, ev.PREFLIGHT_PASSED, f"opened and verified {offer.nbytes} bytes", t0)

    # --- answers ------------------------------------------------------------------------------------------

    def _verdict(
        self, ok: bool, reason: str, message: str, t0: float, *, ipc_closed: bool = True, opened: bool = False
    ) -> Verdict:
        return Verdict(
            ok,
            reason,
            message,
            ipc_closed=ipc_closed,
            opened=opened,
            reader_pid=os.getpid(),
            reader_host=host_id(),
            reader_gpu=self.uuid,
            seconds=time.perf_counter() - t0,
        )

    def _report(
        self, gpu: str, gen: int, attempt: int, verdict: Verdict, offer: Offer | None
    ) -> Verdict | None:
        """Write the verdict (retrying a short outage) and, if ours is the one stored, emit its event."""
        deadline = Deadline(max(5.0, min(30.0, self.settings.timeout_s)))
        while True:
            try:
                written = self.store.write_preflight_result(gen, attempt, gpu, verdict.to_json())
                break
            except MetaStoreUnavailable:
                if deadline.expired:
                    raise
                time.sleep(0.2)
        if not written:
            return None  # another process of this container answered first
        if verdict.ok:
            log.info("IPC preflight of %s (generation %d) passed", gpu, gen)
        else:
            log.warning(
                "IPC preflight of %s (generation %d) failed (%s): %s",
                gpu,
                gen,
                verdict.reason,
                verdict.message,
            )
        # Filed under the trainer's GPU (the offer's), as the trainer's own preflight records are.
        source = EventSource("reader", self.replica, self.rank, gpu)
        nbytes = offer.nbytes if offer is not None else 0
        event = source.preflight(gen, nbytes=nbytes, seconds=verdict.seconds, **event_fields(verdict))
        try:
            self.store.emit(event)
        except MetaStoreError as err:
            log.warning("preflight event not recorded: %s", err)
        return verdict
