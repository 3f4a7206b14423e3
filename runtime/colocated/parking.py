"""Parked steps: published steps whose buckets the writer may not free yet, because a reader may still map
them. They are never reused, and freed once that becomes safe: the step's claimant ACKed it late with its
mappings closed, a later ACK of the same reader supersedes it (a reader opens one step at a time and closes it
before its ACK, unless that ACK lists the step as still `held`), or the reader is gone.
"""

from __future__ import annotations

import logging

from colocate_runtime.colocated.liveness import PeerWatch
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import MalformedAck, MetaStore, MetaStoreError, parse_claim, proves
from colocate_runtime.colocated.pending import PendingStep, claimant_gone, free
from colocate_runtime.colocated.transport import BucketExporter

log = logging.getLogger(__name__)


class Parking:
    def __init__(self, store: MetaStore, exporter: BucketExporter, uuid: str, heartbeat_ttl_s: float) -> None:
        self.store = store
        self.exporter = exporter
        self.uuid = uuid
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._parked: list[PendingStep] = []

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def steps(self) -> list[int]:
        return [p.step for p in self._parked]

    def park(self, pending: PendingStep) -> None:
        if pending.buckets and pending not in self._parked:
            pending.reader_watch = PeerWatch(self.store, "reader", self.uuid, self.heartbeat_ttl_s)
            self._parked.append(pending)
            log.warning("step %d: buckets parked (reader may still map them)", pending.step)

    def reap(self, later: Ack | None = None, step: int | None = None) -> None:
        """Free parked steps that became safe: ACKed late, superseded by a later ACK of the same reader that
        does not say it still maps them (`later`, the ACK of `step`), or their reader is gone. A step whose
        reader reported its close failed stays parked until that reader says otherwise or is gone."""
        still: list[PendingStep] = []
        for p in self._parked:
            release: frozenset[int] | None = None
            if later is not None and step is not None and p.step < step and superseded(p, later):
                release = p.indices() if p.opened is None else p.unopened()
            if release is None:
                try:
                    release = self._late_ack(p)
                    if release is None and p.reader_watch is not None:
                        p.reader_watch.check()
                        if p.reader_watch.dead() or claimant_gone(p.claimant):
                            release = p.indices()
                except MetaStoreError:
                    release = None
            if release is not None:
                free(self.exporter, p, release)
                log.info("step %d: parked buckets freed", p.step)
            else:
                still.append(p)
        self._parked = still

    def _late_ack(self, p: PendingStep) -> frozenset[int] | None:
        """The release set if the parked step's claimant has since ACKed it with its mappings closed."""
        try:
            ack = self.store.read_ack(p.gen, p.step, self.uuid)
        except MalformedAck:
            return None  # no proof of a close; the reader's death can still free them
        if ack is None or not ack.ipc_closed or not ack.reader:
            return None
        owner = p.claimant or self.store.claim_owner(p.gen, p.step, self.uuid)
        if ack.reader != owner or not proves(owner, ack.proof):
            return None
        p.opened = None if ack.opened is None else frozenset(ack.opened)
        return p.unopened()


def superseded(p: PendingStep, later: Ack) -> bool:
    """A later ACK shows that its reader holds no mapping of the parked step `p` (it opens one step at a time
    and closes it before its ACK), unless it lists `p` as still held. It speaks only for itself: a step that
    another reader claimed is not superseded. A step reported still mapped needs the reader's own word."""
    if p.claimant is not None and _who(p.claimant) != _who(later.reader):
        return False
    if later.held is None:
        return not p.mapped
    return (p.gen, p.step) not in later.held


def _who(claim: str | None) -> str | None:
    """The reader behind a step's claim (its identity, without the step's proof digest)."""
    who = parse_claim(claim)
    return None if who is None else who.identity
