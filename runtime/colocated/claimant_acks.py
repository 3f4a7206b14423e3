"""The ACKs that count for the writer: only the step's claimant's, carrying the proof its claim ends with
(metastore.step_claim). Any other ACK, and one that does not decode, frees nothing: it is logged, reported
once (`ack_rejected`), and the wait goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import MalformedAck, MetaStore, MetaStoreUnavailable, proves
from colocate_runtime.colocated.pending import PendingStep

log = logging.getLogger(__name__)


class ClaimantAcks:
    def __init__(self, store: MetaStore, uuid: str, on_rejected: Callable[[PendingStep, str], None]) -> None:
        self.store = store
        self.uuid = uuid
        self.on_rejected = on_rejected  # reports a refused ACK (once per step and reason)

    def spin(self, pending: PendingStep, seconds: float) -> Ack | None:
        """Poll for the ACK for `seconds` before blocking on it. A blocked trainer and an idle Redis server
        wake on cold cores (about 0.3 ms each on the H200 hosts, bench/hop_bench.py), and a short step is
        over in a few ms; polling keeps both awake through the copy. None when the spin ends without an ACK
        (or the store is unreachable): the blocking loop, with its abort and liveness checks, takes over."""
        until = time.perf_counter() + seconds
        try:
            while time.perf_counter() < until:
                ack = self.next(pending, None)
                if ack is not None:
                    return ack
        except MetaStoreUnavailable:
            pass
        return None

    def next(self, pending: PendingStep, timeout_s: float | None) -> Ack | None:
        """The next ACK of the step that its claimant wrote (`timeout_s` None: do not block), noted on
        `pending`. Raises MetaStoreUnavailable."""
        gen, step = pending.gen, pending.step
        try:
            if timeout_s is None:
                ack = self.store.poll_ack(gen, step, self.uuid)
            else:
                ack = self.store.wait_ack(gen, step, self.uuid, timeout_s)
        except MalformedAck as err:
            self._reject(pending, str(err))
            return None
        if ack is None:
            return None
        owner = self.store.claim_owner(gen, step, self.uuid)
        if not ack.reader or ack.reader != owner or not proves(owner, ack.proof):
            why = (
                "does not carry the claim's proof"
                if ack.reader and ack.reader == owner
                else "is not the claimant"
            )
            self._reject(
                pending,
                f"step {step}: ACK ({ack.status}) from {ack.reader or 'an unnamed writer'} refused: it {why} "
                f"(the step is claimed by {owner or 'nobody'})",
            )
            return None
        pending.claimant = owner
        pending.note(ack)
        return ack

    def _reject(self, pending: PendingStep, why: str) -> None:
        if why in pending.rejected:
            return
        pending.rejected.add(why)
        log.error("%s; buckets not freed on its strength", why)
        self.on_rejected(pending, why)
