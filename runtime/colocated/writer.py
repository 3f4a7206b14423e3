"""Trainer side of the colocated update: pack, publish, wait for the ACK, and free only when that is safe.

Per step and GPU: canonical named tensors (from runtime/convert) are packed into dtype-grouped buckets, the
buckets are exported (CUDA IPC, or shared memory on CPU), the manifest is written with `NX` and the step is
pushed onto the GPU's ready list. Then the writer waits, waking every second to check the ACK, the abort
keys, the reader's heartbeat and whether Redis restarted.

The rule the whole protocol serves: a bucket is freed only after an ACK that says `ipc_closed=true`, or once
the reader is known dead, or when the reader provably never opened it (the trainer won the step's claim);
otherwise it is parked until one of those becomes true. `settle.next_move` decides each move from what the
wait observed (observe.py); only the claimant's ACK counts (claimant_acks.py); parked steps and the exports
that stand from one step to the next live in parking.py and standing.py. Before freeing, the writer gives up
torch's CUDA IPC share of every bucket no reader will close (`BucketExporter.release`); otherwise torch keeps
that memory until the trainer exits.

Unless the IPC preflight is `Off`, no step is published on a GPU before its preflight passed in this
incarnation (preflight.py): `start()` runs it, and `publish()` runs it first if `start` did not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NoReturn

import torch

from colocate_runtime.colocated import digest
from colocate_runtime.colocated.buckets import BucketPlan, EntrySpec, plan_buckets
from colocate_runtime.colocated.claimant_acks import ClaimantAcks
from colocate_runtime.colocated.inplace import MIN_ADOPT_BYTES, InPlaceLayout, SourcePiece, adoptable_by
from colocate_runtime.colocated.liveness import Heartbeat, PeerWatch
from colocate_runtime.colocated.manifest import (
    LAYOUT_BY_REFERENCE_BYTES,
    Ack,
    LayoutEncoder,
    WeightDigest,
    encode_manifest,
)
from colocate_runtime.colocated.metastore import MetaStore, MetaStoreError
from colocate_runtime.colocated.observe import StepWatch
from colocate_runtime.colocated.outcome import StepFailed, StepRejected, StepReport
from colocate_runtime.colocated.parking import Parking
from colocate_runtime.colocated.pending import PendingStep, free
from colocate_runtime.colocated.preflight import Verdict
from colocate_runtime.colocated.preflight_trainer import TrainerPreflight
from colocate_runtime.colocated.settle import Act, Move, Shares, ack_failure, next_move, wait_failure
from colocate_runtime.colocated.staging import (
    DigestSample,
    Staged,
    digest_program,
    entry_specs,
    launch_digest,
    manifest_of,
    pack,
    sampled_checksums,
)
from colocate_runtime.colocated.standing import StandingExports
from colocate_runtime.colocated.transport import BucketExporter
from colocate_runtime.colocated.waits import Deadline
from colocate_runtime.colocated.writer_settings import WriterSettings
from colocate_runtime.contract.events import EventSource, StepEvent, final_termination_message
from colocate_runtime.shards import TensorShard

__all__ = ["PendingStep", "WeightWriter", "WriterSettings"]

log = logging.getLogger(__name__)


class WeightWriter:
    def __init__(self, store: MetaStore, exporter: BucketExporter, settings: WriterSettings) -> None:
        self.store = store
        self.exporter = exporter
        self.settings = settings
        self.uuid = exporter.device_uuid()
        self.source = EventSource("trainer", settings.replica, settings.rank, self.uuid)
        self.gen: int | None = None
        self.last_step: int | None = None
        self._parking = Parking(store, exporter, self.uuid, settings.heartbeat_ttl_s)
        self._standing = StandingExports(exporter)
        self._acks = ClaimantAcks(
            store,
            self.uuid,
            lambda p, why: self._emit(p.event(self.source, "ack_rejected", result="error", error=why)),
        )
        self._finished_steps: deque[int] = deque()
        self._state = "idle"
        self._heartbeat: Heartbeat | None = None
        self._run_id = ""
        self._preflight: TrainerPreflight | None = None
        self._preflight_gen: int | None = None  # the incarnation whose preflight passed
        # Layouts repeat from step to step: the last plan (by its specs and cap) and its packed entries.
        self._plan: tuple[list[EntrySpec], int, BucketPlan] | None = None
        self._layout = LayoutEncoder()
        # The weights check's sample of the last layout (its entries, its buckets, the program).
        self._digest: DigestSample | None = None
        self._digest_unchecked = False  # said once: the reader answered without checking the digest

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self, *, preflight: bool = True) -> int:
        """Begin a trainer incarnation (a new `gen`) and start heartbeating, then run the IPC preflight unless
        it is Off or `preflight=False` (the first `publish` runs it then). Returns the generation; raises
        PreflightFailed (Fail mode, or Wait mode past its deadline)."""
        self._standing.retire_all()  # a reader drops its kept mappings when the generation changes
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
        self._standing.retire_all()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._parking:
            log.warning(
                "closing with %d parked step(s) whose reader never confirmed its close; their memory is "
                "released with this process",
                len(self._parking),
            )

    @property
    def parked_steps(self) -> list[int]:
        return self._parking.steps

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
        self._standing.retire_all()
        t0 = time.perf_counter()
        plan = self._plan_of(entry_specs(tensors, shards or {}))
        buckets = pack(self.exporter, plan, tensors, f"g{gen}-s{step}")
        staged = Staged(plan.buckets, plan.entries, buckets, tensors.__getitem__)
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
        standing = self._standing.take(layout, keep_mapped=keep_mapped)  # this step's now, whatever happens
        try:
            buckets = layout.stage(self.exporter, f"g{gen}-s{step}", standing.buckets if standing else None)
        except BaseException:
            if standing is not None:
                self._standing.retire(standing)
            raise
        kept = tuple(range(len(layout.adopted))) if keep_mapped else ()
        staged = Staged(layout.specs, layout.entries, buckets, layout.data, kept, layout if kept else None)
        return self._announce(gen, step, weight_version, staged, t0)

    def _announce(
        self, gen: int, step: int, weight_version: str | None, staged: Staged, t0: float
    ) -> PendingStep:
        """Export the staged buckets and publish their manifest; from here the step is the reader's."""
        buckets = staged.buckets
        try:
            sums = sampled_checksums(staged, step, self.settings.checksum_entries)
            weights = self._digest_launch(step, staged)
            for b in buckets:
                if b.descriptor is None:  # a standing export is published as it is
                    self.exporter.export(b)
            self.exporter.synchronize()
            checked = None
            if weights is not None and self._digest is not None:  # the program that launched it
                per_entry = self._digest[2].finish(weights)
                checked = WeightDigest(self.settings.digest_period, digest.CHUNK_BYTES, per_entry)
            t_pack = time.perf_counter()
            version = weight_version if weight_version is not None else str(step)
            manifest = manifest_of(
                self.settings,
                staged,
                gen=gen,
                step=step,
                gpu=self.uuid,
                transport=self.exporter.kind,
                weight_version=version,
                checksums=sums,
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
        self._emit(pending.event(self.source, "published", seconds=t_pub - t0))
        return pending

    def _digest_launch(self, step: int, staged: Staged) -> torch.Tensor | None:
        """Enqueue the weights check's per-entry sums of what this step publishes (None: the check is off);
        the export's synchronize waits for them."""
        if self.settings.digest_period <= 0:
            return None
        self._digest = digest_program(self._digest, staged, self.settings.digest_period)
        return launch_digest(self._digest[2], step, staged)

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
        self._parking.reap()

    def _plan_of(self, specs: list[EntrySpec]) -> BucketPlan:
        cap = self.settings.bucket_bytes
        if self._plan is None or self._plan[1] != cap or self._plan[0] != specs:
            self._plan = (specs, cap, plan_buckets(specs, cap))
        return self._plan[2]

    def wait_and_free(self, pending: PendingStep) -> StepReport:
        """Wait for the step's ACK and free its buckets (or raise a StepFailed): what each wake-up of the
        wait observes (observe.py) goes to `settle.next_move`, which says what to do."""
        deadline = Deadline(self.settings.step_timeout_s)
        reader = PeerWatch(self.store, "reader", self.uuid, self.settings.heartbeat_ttl_s)
        watch = StepWatch(self.store, self.uuid, self._acks, pending, reader, self._new_run)
        t0 = time.perf_counter()
        ack = self._acks.spin(pending, min(self.settings.ack_spin_s, self.settings.step_timeout_s))
        while (move := next_move(seen := watch.waiting(deadline, ack))).act is Act.WAIT:
            ack = None
        if seen.ack is None:
            assert move.fails is not None
            err = wait_failure(
                seen,
                move.fails,
                step=pending.step,
                gpu=self.uuid,
                timeout_s=self.settings.step_timeout_s,
                store=self.store.address,
            )
            if move.act is Act.GIVE_UP:
                self._give_up(watch, err)
            self._settle(pending, move)
            raise self._failed(pending, err)
        # From the manifest's write (not from this call): the reader may have been at work while the caller
        # did something else, and publish + wait_ack is then the step end to end.
        pending.phase_seconds["wait_ack"] = time.perf_counter() - (pending.published_at or t0)
        if move.act is Act.AWAIT_DEATH:
            while (death := next_move(watch.awaiting_death(deadline))).act is Act.WAIT:
                time.sleep(deadline.slice(0.5))
            self._settle(pending, death)
            freed = not pending.buckets
            raise self._failed(pending, ack_failure(seen.ack, StepRejected, step=pending.step, freed=freed))
        return self._on_ack(pending, seen.ack, move)

    def _on_ack(self, pending: PendingStep, ack: Ack, move: Move) -> StepReport:
        step = pending.step
        t0 = time.perf_counter()
        if move.keep_standing:
            self._standing.keep(pending, ack)
        self._settle(pending, move, ack)
        pending.phase_seconds["free"] = time.perf_counter() - t0
        if move.fails is not None:
            raise self._failed(pending, ack_failure(ack, move.fails, step=step, freed=True))
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
        src, phases = self.source, report.phase_seconds
        self._emit(
            pending.event(src, "acked", seconds=pending.phase_seconds.get("wait_ack", 0.0)),
            pending.event(src, "freed", seconds=pending.phase_seconds["free"]),
            pending.event(src, "finished", result="ok", seconds=report.seconds, phase_seconds=phases),
        )
        self._forget_old_steps(step)
        return report

    def _give_up(self, watch: StepWatch, err: StepFailed) -> NoReturn:
        """Abort or timeout: free at once if the reader never claimed the step, else give it a grace period
        to close what it mapped."""
        seen = watch.revoke(type(err))
        grace = Deadline(2 * self.settings.heartbeat_ttl_s + 1.0)
        while (move := next_move(seen)).act is Act.WAIT:
            seen = watch.giving_up(grace, type(err))
        self._settle(watch.pending, move, seen.ack)
        err.freed = move.act is Act.FREE
        raise self._failed(watch.pending, err)

    def _settle(self, pending: PendingStep, move: Move, ack: Ack | None = None) -> None:
        """Carry out a FREE or a PARK. Freeing on a closed ACK also frees the parked steps it supersedes."""
        if move.act is Act.PARK:
            self._parking.park(pending)
        elif move.act is Act.FREE:
            free(self.exporter, pending, pending.shares(move.shares))
            if move.shares is Shares.UNOPENED:
                self._parking.reap(later=ack, step=pending.step)

    def _new_run(self, run_id: str) -> None:
        self._run_id = run_id

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

    def _failed(self, pending: PendingStep, err: StepFailed) -> StepFailed:
        self._state = "failed"
        log.warning("%s", err)
        seconds = sum(pending.phase_seconds.values())
        phases = pending.phase_seconds
        self._emit(
            pending.event(
                self.source,
                "failed",
                result=err.result,
                error=str(err),
                seconds=seconds,
                phase_seconds=phases,
            )
        )
        return err

    def _emit(self, *events: StepEvent) -> None:
        try:
            self.store.emit(*events)
        except MetaStoreError as err:
            log.warning("step event not recorded: %s", err)
