"""A published step whose buckets the trainer still owns, and the one way to give them back (`free`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.colocated.liveness import PeerWatch, host_id, process_gone
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import parse_claim
from colocate_runtime.colocated.settle import Shares
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.contract.events import EventSource, StepEvent


@dataclass(slots=True)
class PendingStep:
    """A published step whose buckets the writer still owns."""

    gen: int
    step: int
    weight_version: str
    buckets: list[LocalBucket]
    payload_bytes: int
    handles: int
    run_id: str
    phase_seconds: dict[str, float] = field(default_factory=dict)
    reader_watch: PeerWatch | None = None  # set when parked: is the reader that may map them alive?
    published_at: float = 0.0  # perf_counter when the manifest was written: `wait_ack` counts from here
    claimant: str | None = None  # the reader claim holding the step, once known (only its ACKs count)
    opened: frozenset[int] | None = None  # buckets that reader mapped (its ACK says); None: not known
    mapped: bool = False  # its ACK said the close failed: parked until it reports them released or is gone
    rejected: set[str] = field(default_factory=set)  # ACKs already refused (each reported once)
    layout: InPlaceLayout | None = None  # the in-place layout it was staged from, when its buckets were kept
    kept: tuple[int, ...] = ()
    digest: bool = False  # its manifest carried the weights check's digest

    def note(self, ack: Ack) -> None:
        """What the claimant's ACK says about its mappings of this step."""
        self.opened = None if ack.opened is None else frozenset(ack.opened)
        self.mapped = not ack.ipc_closed

    def indices(self) -> frozenset[int]:
        return frozenset(b.index for b in self.buckets)

    def unopened(self) -> frozenset[int]:
        """Buckets the claimant's ACK says it never mapped (none when it did not say)."""
        if self.opened is None:
            return frozenset()
        return frozenset(b.index for b in self.buckets if b.index not in self.opened)

    def shares(self, which: Shares) -> frozenset[int]:
        return self.indices() if which is Shares.ALL else self.unopened()

    def event(
        self,
        source: EventSource,
        phase: str,
        *,
        seconds: float = 0.0,
        result: str = "",
        phase_seconds: dict[str, float] | None = None,
        error: str = "",
    ) -> StepEvent:
        """The trainer's step event of this step."""
        return source.event(
            self.gen,
            self.step,
            phase,
            result=result,
            seconds=seconds,
            phase_seconds=phase_seconds,
            nbytes=self.payload_bytes,
            handles=self.handles,
            weight_version=self.weight_version,
            error=error,
        )


def free(exporter: BucketExporter, pending: PendingStep, release: frozenset[int]) -> None:
    """Free the step's buckets; first give up torch's IPC share of those in `release` (buckets no reader
    mapped, or whose reader is gone): nobody else will, and without it torch keeps their memory until this
    process exits."""
    if pending.buckets:
        exporter.release([b for b in pending.buckets if b.index in release])
        exporter.free(pending.buckets)
        pending.buckets = []


def claimant_gone(claimant: str | None) -> bool:
    """The claiming reader ran on this host (the pod's containers share it) and its process is gone."""
    who = parse_claim(claimant)
    return who is not None and who.host == host_id() and process_gone(who.pid)
