"""Trainer side of a suspend at a step boundary: answer the operator's checkpoint request with a callback.

When a ColocateJob is suspended (by its user or by Kueue) the operator lets the weight sync in flight finish,
writes a checkpoint request into the job's meta-store and deletes the pods once every registered trainer
rank acknowledged it, or once `spec.runPolicy.suspendGracePeriodSeconds` ran out. The trainer's loop:

    requests = CheckpointRequests(store, save_checkpoint, rank=rank)
    requests.register()                       # at start: the operator now waits for this rank's answer
    start = requests.resume_step() or 0       # after a resume: the step the last checkpoint was taken after
    for step in range(start + 1, steps + 1):
        ...                                   # train
        publisher.update(step)                # the step's weight sync, installed in SGLang
        if requests.at_step_boundary(step):   # one GET; on a request: save_checkpoint(step), then the ACK
            break                             # the operator deletes the pods

The records and keys are contract/checkpoint.py's. A trainer that never registers is not waited for (the
operator then waits only for a sync that status shows in flight). A failing callback writes no ACK: the
operator deletes the pods when the grace period ends and says so in status.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from colocate_runtime.colocated.liveness import host_id
from colocate_runtime.colocated.metastore import MetaStore, MetaStoreUnavailable, _translated
from colocate_runtime.contract.checkpoint import (
    CheckpointAck,
    CheckpointKeys,
    CheckpointRecordError,
    CheckpointRequest,
    decode_request,
    decode_step,
    redis_time,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
ACK_RETRY_SECONDS = 10.0  # an ACK not written is retried this long (the operator's grace period covers it)


class CheckpointRequests:
    """One trainer rank's view of the suspend checkpoint records. Not thread-safe: call from the step loop."""

    def __init__(self, store: MetaStore, on_checkpoint: Callable[[int], None], *, rank: int = 0) -> None:
        self.store = store
        self.on_checkpoint = on_checkpoint
        self.rank = rank
        self.keys = CheckpointKeys(store.keys.namespace, store.keys.job)
        self.registered_at: float | None = None  # Redis TIME of register(): older requests are stale
        self.answered: str | None = None  # the id of the request this process acknowledged
        self.checkpointed_step: int | None = None

    @property
    def address(self) -> str:  # for the meta-store's error messages (never the password)
        return self.store.address

    @_translated
    def register(self) -> None:
        """Tell the operator this rank answers checkpoint requests (before the first step)."""
        now = redis_time(self.store.client.time())
        record = json.dumps({"t": now, "pid": os.getpid(), "host": host_id()})
        self.store.client.hset(self.keys.ranks, str(self.rank), record)
        self.registered_at = now

    @_translated
    def resume_step(self) -> int | None:
        """The step the job's last suspend checkpointed after (resume with the step after it), or None."""
        return self._record(self.keys.resume, decode_step, "resume record")

    @_translated
    def pending(self) -> CheckpointRequest | None:
        """A request this rank has yet to answer: newer than its registration, not answered yet."""
        request = self._record(self.keys.request, decode_request, "checkpoint request")
        if request is None or request.id == self.answered:
            return None
        if self.registered_at is not None and request.t < self.registered_at:
            return None  # left from a suspension before this trainer started
        return request

    def _record(self, key: str, decode: Callable[[bytes], T], what: str) -> T | None:
        """The record at `key`, decoded; None when there is none or it does not decode (untrusted)."""
        raw = self.store.client.get(key)
        if raw is None:
            return None
        try:
            return decode(raw)
        except CheckpointRecordError as e:
            log.warning("ignoring the %s %s: %s", what, key, e)
            return None

    def at_step_boundary(self, step: int) -> bool:
        """Call once the weight sync of `step` finished. True: a checkpoint was requested, the callback ran
        and the ACK is written (stop stepping; the pods are about to be deleted). One round trip when there
        is no request; an unreachable meta-store counts as no request (the next boundary asks again)."""
        try:
            request = self.pending()
        except MetaStoreUnavailable as e:
            log.warning("checkpoint request not readable at step %d, asking again next step: %s", step, e)
            return False
        if request is None:
            return False
        log.info("checkpoint requested (%s): checkpointing at step %d", request.reason, step)
        self.on_checkpoint(step)  # raises: no ACK, the operator's grace period ends the wait
        self._acknowledge(CheckpointAck(request.id, step))
        self.answered, self.checkpointed_step = request.id, step
        log.info("checkpointed at step %d (request %s)", step, request.id)
        return True

    def _acknowledge(self, ack: CheckpointAck) -> None:
        deadline = time.monotonic() + ACK_RETRY_SECONDS
        while True:
            try:
                self._write_ack(ack)
                return
            except MetaStoreUnavailable as e:
                if time.monotonic() >= deadline:
                    log.error("checkpoint at step %d taken but its ACK not written: %s", ack.step, e)
                    return
                time.sleep(0.2)

    @_translated
    def _write_ack(self, ack: CheckpointAck) -> None:
        pipe = self.store.client.pipeline(transaction=True)
        pipe.set(self.keys.resume, str(ack.step))
        pipe.hset(self.keys.acks, str(self.rank), ack.to_json())
        pipe.execute()
