"""Trainer side of the colocated update: pack, publish, wait for the ACK, and free only when that is safe.

Per step and GPU: canonical named tensors (from runtime/convert) are packed into dtype-grouped buckets, the
buckets are exported (CUDA IPC, or shared memory on CPU), the manifest is written with `NX` and the step is
pushed onto the GPU's ready list. Then the writer waits, waking every second to check the ACK, the abort
keys, the reader's heartbeat and whether Redis restarted.

The rule the whole protocol serves: a bucket is freed only after an ACK that says `ipc_closed=true`, or once
the reader is known dead, or when the reader provably never opened it (the trainer won the step's claim).
Otherwise the buckets are parked, never reused, and freed later when one of those becomes true (a reader that
acknowledges a later step holds no mapping of an earlier one: it opens one step at a time and closes it
before its ACK), unless that reader reported the earlier step still mapped (its ACKs list such steps as
`held`), or the later ACK is another reader's.

Only the claimant's ACK counts: it names the step's claim and carries the proof whose digest the claim ends
with (metastore.step_claim). Any other ACK, and one that does not decode, is logged, reported once as an
`ack_rejected` event, and frees nothing; the wait goes on. Before freeing, the writer gives up torch's CUDA
IPC share of every bucket no reader will close (never announced, revoked, not in the ACK's `opened` list,
or whose reader is gone: `BucketExporter.release`); otherwise torch keeps that memory until the trainer exits.

Unless the IPC preflight is `Off`, no step is published on a GPU before its preflight passed in this
incarnation (preflight.py): `start()` runs it, and `publish()` runs it first if `start` did not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from colocate_runtime.bits import copy_bits
from colocate_runtime.colocated import checksum, digest
from colocate_runtime.colocated.buckets import BucketPlan, BucketSpec, EntrySpec, PlacedEntry, plan_buckets
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.inplace import (
    MIN_ADOPT_BYTES,
    InPlaceLayout,
    SourcePiece,
    adoptable_by,
)
from colocate_runtime.colocated.liveness import Heartbeat, PeerWatch, host_id, process_gone
from colocate_runtime.colocated.manifest import (
    LAYOUT_BY_REFERENCE_BYTES,
    Ack,
    BucketRecord,
    LayoutEncoder,
    Manifest,
    Producer,
    WeightDigest,
    encode_manifest,
)
from colocate_runtime.colocated.metastore import (
    CLAIM_REVOKED,
    MalformedAck,
    MetaStore,
    MetaStoreError,
    MetaStoreUnavailable,
    is_reader_claim,
    parse_claim,
    proves,
)
from colocate_runtime.colocated.outcome import (
    MetaStoreLost,
    PeerLost,
    StepAborted,
    StepFailed,
    StepRejected,
    StepReport,
    StepTimedOut,
    WeightsMismatch,
)
from colocate_runtime.colocated.preflight import PreflightSettings, Verdict
from colocate_runtime.colocated.preflight_trainer import TrainerPreflight
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.colocated.views import dtype_name, entry_view
from colocate_runtime.colocated.waits import Deadline
from colocate_runtime.contract import env
from colocate_runtime.contract.events import (
    TERMINATION_LOG,
    EventSource,
    StepEvent,
    final_termination_message,
)
from colocate_runtime.shards import TensorShard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriterSettings:
    job: str
    namespace: str
    replica: int = 0
    rank: int = 0
    # The table's defaults (contract/env.py), as a ColocateConfig's.
    bucket_bytes: int = env.BUCKET_MB.default << 20
    step_timeout_s: float = float(env.STEP_TIMEOUT_SECONDS.default)
    heartbeat_ttl_s: float = float(env.HEARTBEAT_TTL_SECONDS.default)
    checksum_entries: int = 0  # > 0: sampled checksums of that many entries per step
    # The weights check of every step (digest.py): every byte sampled within this many steps; 0: off.
    digest_period: int = env.WEIGHT_DIGEST_PERIOD.default
    keep_steps: int = 2  # a step's keys are deleted once this many newer steps finished
    ack_spin_s: float = env.ACK_SPIN_MS.default / 1e3  # poll for the ACK this long first (_spin_for_ack)
    preflight: PreflightSettings = field(default_factory=PreflightSettings)  # Off unless configured
    termination_log: str | None = None  # `finish` also leaves the final record there if it exists

    @staticmethod
    def from_config(cfg: ColocateConfig, *, rank: int = 0, checksum_entries: int = 8) -> WriterSettings:
        return WriterSettings(
            job=cfg.job,
            namespace=cfg.namespace,
            replica=cfg.replica_index,
            rank=rank,
            bucket_bytes=cfg.bucket_bytes,
            step_timeout_s=cfg.step_timeout_s,
            heartbeat_ttl_s=cfg.heartbeat_ttl_s,
            ack_spin_s=cfg.ack_spin_ms / 1e3,
            checksum_entries=checksum_entries if cfg.verify == "SampledChecksum" else 0,
            digest_period=cfg.weight_digest_period,
            preflight=PreflightSettings.from_config(cfg),
            termination_log=TERMINATION_LOG,
        )


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


@dataclass(frozen=True, slots=True)
class _Staged:
    """A step's buckets, filled but not yet exported, with their layout."""

    specs: tuple[BucketSpec, ...]
    entries: tuple[PlacedEntry, ...]
    buckets: list[LocalBucket]
    data: Callable[[str], torch.Tensor]  # an entry's data, for sampled checksums
    kept: tuple[int, ...] = ()  # buckets the reader may keep mapped across steps (the trainer's own storage)
    layout: InPlaceLayout | None = None  # the in-place layout, when kept


@dataclass
class _Standing:
    """Exports of the trainer's own storage that the last step's reader read through its kept mapping
    without opening them: still exported, their share still the trainer's, no reader mapping them. The next
    step of the same layout publishes them again instead of a fresh alias and export each."""

    layout: InPlaceLayout
    buckets: dict[int, LocalBucket]


class WeightWriter:
    def __init__(self, store: MetaStore, exporter: BucketExporter, settings: WriterSettings) -> None:
        self.store = store
        self.exporter = exporter
        self.settings = settings
        self.uuid = exporter.device_uuid()
        self.source = EventSource("trainer", settings.replica, settings.rank, self.uuid)
        self.gen: int | None = None
        self.last_step: int | None = None
        self._parked: list[PendingStep] = []
        self._finished_steps: deque[int] = deque()
        self._state = "idle"
        self._heartbeat: Heartbeat | None = None
        self._run_id = ""
        self._preflight: TrainerPreflight | None = None
        self._preflight_gen: int | None = None  # the incarnation whose preflight passed
        # Layouts repeat from step to step: the last plan (by its specs and cap) and its packed entries.
        self._plan: tuple[list[EntrySpec], int, BucketPlan] | None = None
        self._layout = LayoutEncoder()
        self._standing: _Standing | None = None
        # The weights check's sample of the last layout (its entries, its buckets, the program).
        self._digest: tuple[tuple[PlacedEntry, ...], tuple[int, ...], digest.SampleProgram] | None = None
        self._digest_unchecked = False  # said once: the reader answered without checking the digest

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self, *, preflight: bool = True) -> int:
        """Begin a trainer incarnation (a new `gen`) and start heartbeating, then run the IPC preflight unless
        it is Off or `preflight=False` (the first `publish` runs it then). Returns the generation; raises
        PreflightFailed (Fail mode, or Wait mode past its deadline)."""
        self._retire_standing()  # a reader drops its kept mappings when the generation changes
        self.gen = self.store.start_incarnation(self.uuid)
        self._run_id = self.store.server_run_id()
        gen = self.gen
        self._heartbeat = Heartbeat(
            self.store,
            "trainer",
            self.uuid,
            self.settings.heartbeat_ttl_s,
            info=lambda: {
                "gen": gen,
                "step": self.last_step,
                "state": self._state,
                "rank": self.settings.rank,
            },
            on_beat=lambda: self.store.restore_gen(self.uuid, gen),
        ).start()
        log.info("colocated writer on %s started generation %d", self.uuid, gen)
        device = getattr(self.exporter, "device", None)
        if self.settings.digest_period > 0 and isinstance(device, torch.device):
            digest.warm_up(device)  # compile the check's kernel now rather than in the first step
        if preflight and self.settings.preflight.enabled:
            self.preflight()
        return gen

    def preflight(self) -> Verdict:
        """Run the IPC preflight of this incarnation on this GPU; blocks as its mode says (preflight.py)."""
        gen = self._gen()
        if self._preflight is None:
            self._preflight = TrainerPreflight(
                self.store,
                self.exporter,
                self.settings.preflight,
                replica=self.settings.replica,
                rank=self.settings.rank,
                emit=self._emit,
            )
        state, self._state = self._state, "preflight"
        try:
            verdict = self._preflight.run(gen)
        finally:
            self._state = state
        self._preflight_gen = gen
        return verdict

    @property
    def preflight_passed(self) -> bool:
        return self._preflight_gen is not None and self._preflight_gen == self.gen

    def finish(self, *, ok: bool = True, error: str = "") -> None:
        """The last record of a training run (`final=true`): the operator's proof that training succeeded."""
        self._emit(
            self.source.event(
                self._gen(),
                self.last_step or 0,
                "final",
                result="ok" if ok else "error",
                final=True,
                error=error,
            )
        )
        path = self.settings.termination_log
        if ok and path and os.path.isfile(path):  # Kubernetes provides the file; never created elsewhere
            try:
                with open(path, "w") as log_file:
                    log_file.write(final_termination_message(self.last_step or 0))
            except OSError as e:
                log.warning("could not leave the final record in %s: %s", path, e)

    def close(self) -> None:
        self._retire_standing()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._parked:
            log.warning(
                "closing with %d parked step(s) whose reader never confirmed its close; their memory is "
                "released with this process",
                len(self._parked),
            )

    @property
    def parked_steps(self) -> list[int]:
        return [p.step for p in self._parked]

    # --- one step -----------------------------------------------------------------------------------------

    def update(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        shards: Mapping[str, TensorShard] | None = None,
        weight_version: str | None = None,
    ) -> StepReport:
        """Publish one step and wait until its buckets are freed (or raise a StepFailed)."""
        return self.wait_and_free(self.publish(step, tensors, shards=shards, weight_version=weight_version))

    def publish(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        shards: Mapping[str, TensorShard] | None = None,
        weight_version: str | None = None,
        again: bool = False,
    ) -> PendingStep:
        """`again`: `step` is the last published step, published once more (`republish`)."""
        gen = self._gen()
        self._before_publish(step, again=again)
        self._retire_standing()
        t0 = time.perf_counter()
        shards = shards or {}
        specs = []
        for name, t in tensors.items():
            shard = shards.get(name)
            specs.append(EntrySpec(name, dtype_name(t.dtype), tuple(t.shape), shard))
        plan = self._plan_of(specs)
        tag = f"g{gen}-s{step}"
        buckets = [self.exporter.allocate(b.index, b.nbytes, tag) for b in plan.buckets]
        try:
            with torch.no_grad():
                for e in plan.entries:
                    flat = buckets[e.bucket].tensor
                    assert flat is not None
                    copy_bits(entry_view(flat, e), tensors[e.name])
        except BaseException:
            self.exporter.free(buckets)
            raise
        staged = _Staged(plan.buckets, plan.entries, buckets, tensors.__getitem__)
        return self._announce(gen, step, weight_version, staged, t0)

    def in_place_layout(
        self, pieces: Sequence[SourcePiece], *, min_adopt_bytes: int = MIN_ADOPT_BYTES
    ) -> InPlaceLayout:
        """Compile once per layout (e.g. `trainer_plan(...).bind(model chunks)`) for `publish_in_place`."""
        return InPlaceLayout.compile(
            pieces,
            adoptable=adoptable_by(self.exporter),
            bucket_bytes=self.settings.bucket_bytes,
            min_adopt_bytes=min_adopt_bytes,
        )

    def publish_in_place(
        self,
        step: int,
        layout: InPlaceLayout,
        *,
        weight_version: str | None = None,
        again: bool = False,
        keep_mapped: bool = False,
    ) -> PendingStep:
        """Publish one step straight from the trainer's storage (inplace.py): its adopted storages are
        exported as they are and only the rest is packed. The trainer must not write its parameters until
        the step is freed (`wait_and_free` returned). `keep_mapped`: the reader may keep the adopted storages
        mapped until a later manifest stops naming them (kept.py), which saves the open and the unmapping of
        every step; only for a trainer whose parameters stay allocated where they are between steps (no
        offload, no freeing: the memory stays mapped in the reader until then)."""
        gen = self._gen()
        self._before_publish(step, again=again)
        t0 = time.perf_counter()
        standing = self._standing
        self._standing = None  # its exports belong to this step now, whatever happens to it
        if standing is not None and (not keep_mapped or standing.layout is not layout):
            self._retire(standing)
            standing = None
        try:
            buckets = layout.stage(self.exporter, f"g{gen}-s{step}", standing.buckets if standing else None)
        except BaseException:
            if standing is not None:
                self._retire(standing)
            raise
        kept = tuple(range(len(layout.adopted))) if keep_mapped else ()
        staged = _Staged(layout.specs, layout.entries, buckets, layout.data, kept, layout if kept else None)
        return self._announce(gen, step, weight_version, staged, t0)

    def _announce(
        self, gen: int, step: int, weight_version: str | None, staged: _Staged, t0: float
    ) -> PendingStep:
        """Export the staged buckets and publish their manifest; from here the step is the reader's."""
        buckets = staged.buckets
        try:
            sums = {}
            if self.settings.checksum_entries > 0:
                names = checksum.sample_names(
                    [e.name for e in staged.entries], step, self.settings.checksum_entries
                )
                values = checksum.tensor_checksums([staged.data(n) for n in names])
                sums = dict(zip(names, values, strict=True))
            weights = self._digest_launch(step, staged)
            for b in buckets:
                if b.descriptor is None:  # a standing export is published as it is
                    self.exporter.export(b)
            self.exporter.synchronize()
            checked = None
            if weights is not None:
                per_entry = digest.SampleProgram.finish(weights)
                checked = WeightDigest(self.settings.digest_period, digest.CHUNK_BYTES, per_entry)
            t_pack = time.perf_counter()
            version = weight_version if weight_version is not None else str(step)
            manifest = Manifest(
                job=self.settings.job,
                namespace=self.settings.namespace,
                gen=gen,
                step=step,
                gpu=self.uuid,
                weight_version=version,
                transport=self.exporter.kind,
                producer=Producer(self.settings.rank, self.settings.replica, os.getpid(), host_id()),
                buckets=tuple(
                    BucketRecord(s.index, s.dtype, s.nbytes, b.descriptor or {})
                    for s, b in zip(staged.specs, buckets, strict=True)
                ),
                entries=staged.entries,
                checksums=sums,
                kept=staged.kept,
                digest=checked,
            )
            run_id = self._run_id  # refreshed on the wait loop's wake-ups, not on this path
            # A large layout is stored once under its hash and named by the manifest (not 5 MB a step).
            packed = self._layout.entries_bytes(staged.entries)
            by_reference = len(packed) >= LAYOUT_BY_REFERENCE_BYTES
            blob = encode_manifest(manifest, self._layout, by_reference=by_reference)
            layout = (self._layout.ref, packed) if by_reference else None
            self.store.publish_manifest(gen, step, self.uuid, blob, layout=layout)
        except BaseException:
            # Nothing was announced (or the announcement failed): no reader can hold these buckets.
            self.exporter.release(buckets)
            self.exporter.free(buckets)
            raise
        t_pub = time.perf_counter()
        self.last_step = step
        self._state = "published"
        pending = PendingStep(
            gen,
            step,
            version,
            buckets,
            sum(e.nbytes for e in staged.entries),
            len(buckets),
            run_id,
            {"pack": t_pack - t0, "publish": t_pub - t_pack},
            published_at=t_pub,
            layout=staged.layout,
            kept=staged.kept,
            digest=checked is not None,
        )
        self._emit(self._event(pending, "published", seconds=t_pub - t0))
        return pending

    def _digest_launch(self, step: int, staged: _Staged) -> torch.Tensor | None:
        """Enqueue the weights check's per-entry sums of what this step publishes (None: the check is off);
        the export's synchronize waits for them."""
        period = self.settings.digest_period
        if period <= 0:
            return None
        order = tuple(s.index for s in staged.specs)
        cached = self._digest
        same = cached is not None and (cached[0] is staged.entries or cached[0] == staged.entries)
        if cached is None or not same or cached[1] != order or cached[2].period != period:
            flat = staged.buckets[0].tensor if staged.buckets else None
            device = flat.device if flat is not None else torch.device("cpu")
            cached = (staged.entries, order, digest.trainer_program(staged.entries, order, period, device))
            self._digest = cached
        by_index = {b.index: b.tensor for b in staged.buckets}

        def bucket(index: int) -> torch.Tensor:
            flat = by_index[index]
            assert flat is not None
            return flat

        return cached[2].launch(step, bucket)

    def republish(self) -> int:
        """Make the last published step publishable once more, for a restarted reader (repush.py): its keys
        on this GPU are deleted (the new reader instance claims and acknowledges it afresh). Returns the step;
        then `publish(step, ..., again=True)` or `publish_in_place(step, ..., again=True)` with the weights
        the trainer holds now."""
        if self.last_step is None:
            raise ValueError("no step published yet: nothing to publish again")
        self.store.clear_step(self._gen(), self.last_step, self.uuid)
        with contextlib.suppress(ValueError):
            self._finished_steps.remove(self.last_step)
        return self.last_step

    def _before_publish(self, step: int, *, again: bool = False) -> None:
        if again and step != self.last_step:
            raise ValueError(f"step {step} is not the last published step {self.last_step}: not again")
        if not again and self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is not after the last published step {self.last_step}")
        if self.settings.preflight.enabled and not self.preflight_passed:
            self.preflight()  # raises rather than publish to a reader side that cannot open it
        if self._preflight is not None and self._preflight.parked:
            self._preflight.reap()
        self._reap_parked()

    def _plan_of(self, specs: list[EntrySpec]) -> BucketPlan:
        cap = self.settings.bucket_bytes
        if self._plan is None or self._plan[1] != cap or self._plan[0] != specs:
            self._plan = (specs, cap, plan_buckets(specs, cap))
        return self._plan[2]

    def wait_and_free(self, pending: PendingStep) -> StepReport:
        gen, step = pending.gen, pending.step
        deadline = Deadline(self.settings.step_timeout_s)
        reader = PeerWatch(self.store, "reader", self.uuid, self.settings.heartbeat_ttl_s)
        t0 = time.perf_counter()
        unreachable: str | None = None
        ack = self._spin_for_ack(pending)
        while True:
            try:
                if ack is None:
                    ack = self._bound_ack(pending, deadline.slice())
                unreachable = None
                if ack is not None:
                    # From the manifest's write (not from this call): the reader may have been at work while
                    # the caller did something else, and publish + wait_ack is then the step end to end.
                    start = pending.published_at or t0
                    pending.phase_seconds["wait_ack"] = time.perf_counter() - start
                    return self._on_ack(pending, ack, reader, deadline)
                reason = self.store.abort_reason(gen, step)
                if reason is not None:
                    return self._give_up(
                        pending, reader, StepAborted(f"step {step} aborted: {reason}", step=step)
                    )
                reader.check()
                if self.store.server_run_id() != pending.run_id:
                    self._check_restart(pending)
            except MetaStoreUnavailable as err:
                unreachable = str(err)
                time.sleep(min(0.2, deadline.remaining()))
            if unreachable is None and reader.dead() and self._reader_was_here(pending, reader):
                self._free(pending, self._all(pending))
                raise self._failed(
                    pending,
                    PeerLost(
                        f"reader on {self.uuid} stopped heartbeating during step {step}; buckets freed",
                        step=step,
                        freed=True,
                    ),
                )
            if deadline.expired:
                if unreachable is not None:
                    self._park(pending)
                    raise self._failed(
                        pending,
                        MetaStoreLost(
                            f"step {step}: {unreachable} for the whole step timeout; buckets parked",
                            step=step,
                            freed=False,
                        ),
                    )
                return self._give_up(
                    pending,
                    reader,
                    StepTimedOut(
                        f"step {step}: no ACK from the reader on {self.uuid} "
                        f"within {self.settings.step_timeout_s}s",
                        step=step,
                    ),
                )

    # --- outcomes -----------------------------------------------------------------------------------------

    def _on_ack(self, pending: PendingStep, ack: Ack, reader: PeerWatch, deadline: Deadline) -> StepReport:
        step = pending.step
        pending.opened = None if ack.opened is None else frozenset(ack.opened)
        if not ack.ipc_closed:
            # The reader could not verify its close: only its death (or its word that the mappings are gone,
            # in a later ACK) makes the memory safe to reuse.
            pending.mapped = True
            self._wait_for_death(pending, reader, deadline)
            raise self._failed(
                pending,
                StepRejected(
                    f"step {step}: reader failed without closing its mappings ({ack.error}); "
                    f"buckets {'freed after its death' if not pending.buckets else 'parked'}",
                    step=step,
                    freed=not pending.buckets,
                ),
            )
        t0 = time.perf_counter()
        if ack.status == "ok" and not ack.checksum_mismatches:
            self._keep_standing(pending, ack)
        self._free(pending, self._unopened(pending))
        self._reap_parked(later=ack, step=step)
        pending.phase_seconds["free"] = time.perf_counter() - t0
        if ack.digest_mismatches:
            raise self._failed(
                pending,
                WeightsMismatch(
                    f"step {step} failed in the reader: {ack.error}",
                    parameters=ack.digest_mismatches,
                    step=step,
                    freed=True,
                ),
            )
        if ack.status != "ok" or ack.checksum_mismatches:
            detail = ack.error or f"checksum mismatch in {list(ack.checksum_mismatches)}"
            kind = StepAborted if ack.result == StepAborted.result else StepRejected
            raise self._failed(
                pending, kind(f"step {step} failed in the reader: {detail}", step=step, freed=True)
            )
        if pending.digest and not ack.digest_checked and not self._digest_unchecked:
            self._digest_unchecked = True
            log.warning("step %d: the reader did not check the weights digest (an older reader?)", step)
        self._state = "idle"
        report = StepReport(
            pending.gen,
            step,
            pending.weight_version,
            pending.payload_bytes,
            pending.handles,
            dict(pending.phase_seconds),
            ack.gc_fallback,
        )
        self._emit(
            self._event(pending, "acked", seconds=pending.phase_seconds.get("wait_ack", 0.0)),
            self._event(pending, "freed", seconds=pending.phase_seconds["free"]),
            self._event(
                pending, "finished", result="ok", seconds=report.seconds, phase_seconds=report.phase_seconds
            ),
        )
        self._forget_old_steps(step)
        return report

    def _give_up(self, pending: PendingStep, reader: PeerWatch, err: StepFailed) -> StepReport:
        """Abort or timeout: free at once if the reader never claimed the step, else wait for its close."""
        step = pending.step
        try:
            self.store.abort(pending.gen, step, f"writer gave up: {type(err).__name__}", "trainer")
            winner = self.store.claim(pending.gen, step, self.uuid, CLAIM_REVOKED)
        except MetaStoreError:
            winner = None
        if winner == CLAIM_REVOKED:
            self._free(pending, self._all(pending))  # no reader will ever map them
            err.freed = True
            raise self._failed(pending, err)
        if is_reader_claim(winner):
            pending.claimant = winner
        # The reader holds (or may hold) a mapping; it checks the abort key and will ACK after closing.
        grace = Deadline(2 * self.settings.heartbeat_ttl_s + 1.0)
        while not grace.expired:
            try:
                ack = self._bound_ack(pending, grace.slice())
                if ack is not None:
                    pending.opened = None if ack.opened is None else frozenset(ack.opened)
                    pending.mapped = not ack.ipc_closed
                if ack is not None and ack.ipc_closed:
                    self._free(pending, self._unopened(pending))
                    self._reap_parked(later=ack, step=step)
                    err.freed = True
                    raise self._failed(pending, err)
                reader.check()
            except MetaStoreUnavailable:
                time.sleep(min(0.2, grace.remaining()))
            if reader.dead() or _claimant_gone(pending.claimant):
                self._free(pending, self._all(pending))
                err.freed = True
                raise self._failed(pending, err)
        self._park(pending)
        err.freed = False
        raise self._failed(pending, err)

    def _wait_for_death(self, pending: PendingStep, reader: PeerWatch, deadline: Deadline) -> None:
        while not deadline.expired:
            with contextlib.suppress(MetaStoreUnavailable):
                reader.check()
            if reader.dead() or _claimant_gone(pending.claimant):
                self._free(pending, self._all(pending))
                return
            time.sleep(deadline.slice(0.5))
        self._park(pending)

    def _check_restart(self, pending: PendingStep) -> None:
        """Redis restarted: our gen goes back; if the step's manifest is gone, nobody can finish the step."""
        self._run_id = self.store.server_run_id()
        self.store.restore_gen(self.uuid, pending.gen)
        if not self.store.manifest_exists(pending.gen, pending.step, self.uuid):
            self._park(pending)
            raise self._failed(
                pending,
                MetaStoreLost(
                    f"meta-store {self.store.address} restarted during step {pending.step} and lost its "
                    "keys; "
                    "buckets parked until the reader acknowledges a later step",
                    step=pending.step,
                    freed=False,
                ),
            )
        pending.run_id = self._run_id

    def _reader_was_here(self, pending: PendingStep, reader: PeerWatch) -> bool:
        """A silent reader that was never seen may just be starting: it is lost only if it had claimed."""
        if reader.ever_seen:
            return True
        try:
            return is_reader_claim(self.store.claim_owner(pending.gen, pending.step, self.uuid))
        except MetaStoreError:
            return False

    # --- ACKs ---------------------------------------------------------------------------------------------

    def _spin_for_ack(self, pending: PendingStep) -> Ack | None:
        """Poll for the ACK for `ack_spin_s` before blocking on it. A blocked trainer and an idle Redis server
        wake on cold cores (about 0.3 ms each on the H200 hosts, bench/hop_bench.py), and a short step is
        over in a few ms; polling keeps both awake through the copy. None when the spin ends without an ACK
        (or the store is unreachable): the blocking loop, with its abort and liveness checks, takes over."""
        until = time.perf_counter() + min(self.settings.ack_spin_s, self.settings.step_timeout_s)
        try:
            while time.perf_counter() < until:
                ack = self._bound_ack(pending, None)
                if ack is not None:
                    return ack
        except MetaStoreUnavailable:
            pass
        return None

    def _bound_ack(self, pending: PendingStep, timeout_s: float | None) -> Ack | None:
        """The next ACK of the step that its claimant wrote (`timeout_s` None: do not block). Any other (from
        a process that does not hold the claim, or one that does not decode) frees nothing: it is logged and
        reported once, and the wait goes on. Raises MetaStoreUnavailable."""
        gen, step = pending.gen, pending.step
        try:
            if timeout_s is None:
                ack = self.store.poll_ack(gen, step, self.uuid)
            else:
                ack = self.store.wait_ack(gen, step, self.uuid, timeout_s)
        except MalformedAck as err:
            self._reject_ack(pending, str(err))
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
            self._reject_ack(
                pending,
                f"step {step}: ACK ({ack.status}) from {ack.reader or 'an unnamed writer'} refused: it {why} "
                f"(the step is claimed by {owner or 'nobody'})",
            )
            return None
        pending.claimant = owner
        return ack

    def _reject_ack(self, pending: PendingStep, why: str) -> None:
        if why in pending.rejected:
            return
        pending.rejected.add(why)
        log.error("%s; buckets not freed on its strength", why)
        self._emit(self._event(pending, "ack_rejected", result="error", error=why))

    # --- memory -------------------------------------------------------------------------------------------

    def _free(self, pending: PendingStep, release: frozenset[int]) -> None:
        """Free the step's buckets; first give up torch's IPC share of those in `release` (buckets no reader
        mapped, or whose reader is gone): nobody else will, and without it torch keeps their memory until
        this process exits."""
        if pending.buckets:
            self.exporter.release([b for b in pending.buckets if b.index in release])
            self.exporter.free(pending.buckets)
            pending.buckets = []

    def _keep_standing(self, pending: PendingStep, ack: Ack) -> None:
        """Set aside the step's exports of the trainer's own storage that its reader read through a kept
        mapping without opening them (kept.py): nobody maps them, and the next step publishes them again."""
        if pending.layout is None or pending.opened is None:
            return
        unopened = (set(pending.kept) & set(ack.kept)) - pending.opened
        standing = {b.index: b for b in pending.buckets if b.index in unopened and b.descriptor is not None}
        if standing:
            pending.buckets = [b for b in pending.buckets if b.index not in standing]
            self._standing = _Standing(pending.layout, standing)

    def _retire_standing(self) -> None:
        standing, self._standing = self._standing, None
        if standing is not None:
            self._retire(standing)

    def _retire(self, standing: _Standing) -> None:
        """No step will publish these exports again: give their share back and drop the aliases."""
        buckets = list(standing.buckets.values())
        self.exporter.release(buckets)
        self.exporter.free(buckets)

    @staticmethod
    def _all(pending: PendingStep) -> frozenset[int]:
        return frozenset(b.index for b in pending.buckets)

    @staticmethod
    def _unopened(pending: PendingStep) -> frozenset[int]:
        """Buckets the claimant's ACK says it never mapped (none when it did not say)."""
        if pending.opened is None:
            return frozenset()
        return frozenset(b.index for b in pending.buckets if b.index not in pending.opened)

    def _park(self, pending: PendingStep) -> None:
        if pending.buckets and pending not in self._parked:
            pending.reader_watch = PeerWatch(self.store, "reader", self.uuid, self.settings.heartbeat_ttl_s)
            self._parked.append(pending)
            log.warning("step %d: buckets parked (reader may still map them)", pending.step)

    def _reap_parked(self, later: Ack | None = None, step: int | None = None) -> None:
        """Free parked steps that became safe: ACKed late, superseded by a later ACK of the same reader that
        does not say it still maps them (`later`, the ACK of `step`), or their reader is gone. A step whose
        reader reported its close failed stays parked until that reader says otherwise or is gone."""
        still: list[PendingStep] = []
        for p in self._parked:
            release: frozenset[int] | None = None
            if later is not None and step is not None and p.step < step and _superseded(p, later):
                release = self._all(p) if p.opened is None else self._unopened(p)
            if release is None:
                try:
                    release = self._late_ack(p)
                    if release is None and p.reader_watch is not None:
                        p.reader_watch.check()
                        if p.reader_watch.dead() or _claimant_gone(p.claimant):
                            release = self._all(p)
                except MetaStoreError:
                    release = None
            if release is not None:
                self._free(p, release)
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
        return self._unopened(p)

    def _forget_old_steps(self, step: int) -> None:
        self._finished_steps.append(step)
        old = []
        while len(self._finished_steps) > self.settings.keep_steps:
            old.append(self._finished_steps.popleft())
        if old:
            try:
                self.store.delete_steps(self._gen(), old, self.uuid)
            except MetaStoreError as err:
                log.info("old step keys not deleted (they expire anyway): %s", err)

    # --- events -------------------------------------------------------------------------------------------

    def _gen(self) -> int:
        if self.gen is None:
            raise RuntimeError("WeightWriter.start() was not called")
        return self.gen

    def _event(
        self,
        pending: PendingStep,
        phase: str,
        *,
        seconds: float = 0.0,
        result: str = "",
        phase_seconds: dict[str, float] | None = None,
        error: str = "",
    ) -> StepEvent:
        return self.source.event(
            pending.gen,
            pending.step,
            phase,
            result=result,
            seconds=seconds,
            phase_seconds=phase_seconds,
            nbytes=pending.payload_bytes,
            handles=pending.handles,
            weight_version=pending.weight_version,
            error=error,
        )

    def _failed(self, pending: PendingStep, err: StepFailed) -> StepFailed:
        self._state = "failed"
        log.warning("%s", err)
        self._emit(
            self._event(
                pending,
                "failed",
                result=err.result,
                error=str(err),
                seconds=sum(pending.phase_seconds.values()),
                phase_seconds=pending.phase_seconds,
            )
        )
        return err

    def _emit(self, *events: StepEvent) -> None:
        try:
            self.store.emit(*events)
        except MetaStoreError as err:
            log.warning("step event not recorded: %s", err)


def _superseded(p: PendingStep, later: Ack) -> bool:
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


def _claimant_gone(claimant: str | None) -> bool:
    """The claiming reader ran on this host (the pod's containers share it) and its process is gone."""
    who = parse_claim(claimant)
    return who is not None and who.host == host_id() and process_gone(who.pid)
