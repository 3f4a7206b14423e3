"""The I/O side of the writer's wait for a step: what one wake-up sees, gathered into a `settle.Observed` for
`settle.next_move`. Each wake-up stops at the first thing that decides the move, so it makes no Redis round
trip more than the decision needs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from colocate_runtime.colocated.claimant_acks import ClaimantAcks
from colocate_runtime.colocated.liveness import PeerWatch
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import (
    CLAIM_REVOKED,
    MetaStore,
    MetaStoreError,
    MetaStoreUnavailable,
    is_reader_claim,
)
from colocate_runtime.colocated.outcome import StepFailed, StepRejected
from colocate_runtime.colocated.pending import PendingStep, claimant_gone
from colocate_runtime.colocated.settle import Observed, Phase
from colocate_runtime.colocated.waits import Deadline


@dataclass(slots=True)
class StepWatch:
    store: MetaStore
    uuid: str
    acks: ClaimantAcks
    pending: PendingStep
    reader: PeerWatch
    new_run: Callable[[str], None]  # told the server's run id after Redis restarted

    def waiting(self, deadline: Deadline, ack: Ack | None = None) -> Observed:
        """One wake-up of the wait for the ACK (`ack`: one the spin already has)."""
        pending = self.pending
        try:
            if ack is None:
                ack = self.acks.next(pending, deadline.slice())
            if ack is not None:
                return Observed(ack=ack)
            reason = self.store.abort_reason(pending.gen, pending.step)
            if reason is not None:
                return Observed(abort=reason)
            self.reader.check()
            if self.store.server_run_id() != pending.run_id and self._keys_lost():
                return Observed(keys_lost=True)
        except MetaStoreUnavailable as err:
            time.sleep(min(0.2, deadline.remaining()))
            return Observed(unreachable=str(err), expired=deadline.expired)
        lost = self.reader.dead() and self._reader_was_here()
        return Observed(reader_lost=lost, expired=deadline.expired)

    def revoke(self, failing: type[StepFailed]) -> Observed:
        """Giving up: write the abort and try to take the step's claim back (won: no reader ever maps it)."""
        pending = self.pending
        try:
            self.store.abort(pending.gen, pending.step, f"writer gave up: {failing.__name__}", "trainer")
            winner = self.store.claim(pending.gen, pending.step, self.uuid, CLAIM_REVOKED)
        except MetaStoreError:
            winner = None
        if is_reader_claim(winner):
            pending.claimant = winner
        return Observed(Phase.GIVING_UP, revoked=winner == CLAIM_REVOKED, failing=failing)

    def giving_up(self, grace: Deadline, failing: type[StepFailed]) -> Observed:
        """One wake-up of the grace period: the reader checks the abort key and ACKs after closing."""
        ack = None
        try:
            ack = self.acks.next(self.pending, grace.slice())
            if ack is not None and ack.ipc_closed:
                return Observed(Phase.GIVING_UP, ack=ack, failing=failing)
            self.reader.check()
        except MetaStoreUnavailable:
            time.sleep(min(0.2, grace.remaining()))
        lost = self.reader.dead() or claimant_gone(self.pending.claimant)
        return Observed(Phase.GIVING_UP, ack=ack, reader_lost=lost, expired=grace.expired, failing=failing)

    def awaiting_death(self, deadline: Deadline) -> Observed:
        """One wake-up while a reader that could not close its mappings may still map them."""
        expired = deadline.expired
        lost = False
        if not expired:
            with contextlib.suppress(MetaStoreUnavailable):
                self.reader.check()
            lost = self.reader.dead() or claimant_gone(self.pending.claimant)
        return Observed(Phase.AWAITING_DEATH, reader_lost=lost, expired=expired, failing=StepRejected)

    def _keys_lost(self) -> bool:
        """Redis restarted: our gen goes back; if the step's manifest is gone, nobody can finish the step."""
        pending = self.pending
        run_id = self.store.server_run_id()
        self.new_run(run_id)
        self.store.restore_gen(self.uuid, pending.gen)
        if not self.store.manifest_exists(pending.gen, pending.step, self.uuid):
            return True
        pending.run_id = run_id
        return False

    def _reader_was_here(self) -> bool:
        """A silent reader that was never seen may just be starting: it is lost only if it had claimed."""
        if self.reader.ever_seen:
            return True
        try:
            return is_reader_claim(self.store.claim_owner(self.pending.gen, self.pending.step, self.uuid))
        except MetaStoreError:
            return False
