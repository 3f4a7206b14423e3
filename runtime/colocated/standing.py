"""Standing exports: exports of the trainer's own storage that the last step's reader read through its kept
mapping (kept.py) without opening them. They stay exported, their share still the trainer's, no reader
mapping them; the next step of the same layout publishes them again instead of a fresh alias and export each.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.pending import PendingStep
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket


@dataclass
class Standing:
    layout: InPlaceLayout
    buckets: dict[int, LocalBucket]


class StandingExports:
    """At most one layout's standing exports, between one step's ACK and the next step's publish."""

    def __init__(self, exporter: BucketExporter) -> None:
        self.exporter = exporter
        self._standing: Standing | None = None

    def keep(self, pending: PendingStep, ack: Ack) -> None:
        """Set aside the step's exports of the trainer's own storage that its reader read through a kept
        mapping without opening them: nobody maps them, and the next step publishes them again."""
        if pending.layout is None or pending.opened is None:
            return
        unopened = (set(pending.kept) & set(ack.kept)) - pending.opened
        standing = {b.index: b for b in pending.buckets if b.index in unopened and b.descriptor is not None}
        if standing:
            pending.buckets = [b for b in pending.buckets if b.index not in standing]
            self._standing = Standing(pending.layout, standing)

    def take(self, layout: InPlaceLayout, *, keep_mapped: bool) -> Standing | None:
        """The exports a step of `layout` publishes again (they belong to that step now, whatever happens to
        it); any others are retired."""
        standing, self._standing = self._standing, None
        if standing is not None and (not keep_mapped or standing.layout is not layout):
            self.retire(standing)
            return None
        return standing

    def retire_all(self) -> None:
        standing, self._standing = self._standing, None
        if standing is not None:
            self.retire(standing)

    def retire(self, standing: Standing) -> None:
        """No step will publish these exports again: give their share back and drop the aliases."""
        buckets = list(standing.buckets.values())
        self.exporter.release(buckets)
        self.exporter.free(buckets)
