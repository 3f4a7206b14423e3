"""Inference side of the colocated update: open each bucket once, copy into the parameters, force the close,
then ACK.

The reader runs where the parameters live (inside the SGLang worker of its GPU; see sglang/loader.py). It
follows the trainer's current incarnation, waits for the next step on its GPU's ready list, claims the step
(so a trainer that gave up cannot free buckets under it), opens each bucket once, copies every entry into the
matching target parameter (the layout's copy program, reader_program.py), and hands whatever the local copy
cannot fill to the `Exchange` seam (exchange_seam.py: the cross-GPU exchange of runtime/p2p plugs in there
when the inference layout differs from the trainer's). It then closes every mapping verifiably (close.py),
compares sampled checksums, and writes the ACK with `ipc_closed`.

It opens at most one step at a time and closes it before acknowledging, so an ACK for a step also says that
no mapping of any earlier step is still open; the writer relies on that to free parked buckets. The one
exception is what a manifest lets it keep (`Manifest.kept`, kept.py): the trainer's own storage, which the
trainer does not free.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import logging
import math
import os
import secrets
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from colocate_runtime.colocated import checksum, digest, fastcopy
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.close import CloseError, CloseReport, ImportScope
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.exchange_seam import Exchange, ExchangeRequest
from colocate_runtime.colocated.fp8_block import BlockFp8
from colocate_runtime.colocated.fp8_copy import FP32_SCALES
from colocate_runtime.colocated.history import UpdateHistory, UpdateRecord
from colocate_runtime.colocated.kept import KeptMappings
from colocate_runtime.colocated.liveness import Heartbeat, PeerWatch, host_id
from colocate_runtime.colocated.manifest import (
    DIGEST_NAMES_MAX,
    Ack,
    LayoutCache,
    Manifest,
    ManifestError,
    decode_manifest,
)
from colocate_runtime.colocated.metastore import (
    MetaStore,
    MetaStoreError,
    MetaStoreUnavailable,
    StepFetch,
    reader_identity,
    step_claim,
)
from colocate_runtime.colocated.outcome import (
    CoverageError,
    MetaStoreLost,
    PeerLost,
    StaleStep,
    StepAborted,
    StepFailed,
    StepReport,
    StepTimedOut,
    WeightsMismatch,
)
from colocate_runtime.colocated.reader_program import CopyProgram, ProgramCache, compile_program
from colocate_runtime.colocated.transport import BucketImporter
from colocate_runtime.colocated.views import entry_view
from colocate_runtime.colocated.waits import Deadline
from colocate_runtime.contract import env
from colocate_runtime.contract.events import EventSource, StepEvent
from colocate_runtime.shards import Box, TensorShard

if TYPE_CHECKING:
    from colocate_runtime.colocated.preflight_reader import PreflightResponder

log = logging.getLogger(__name__)

OVERLAP_MIN_BYTES = 64 << 20  # buckets this large start copying before the next bucket is opened


@dataclass(frozen=True, slots=True)
class ReaderBenchSwitches:
    """Benchmark-only: each switch brings back a cost the reader avoids, so a measurement can compare against
    it (bench/colocated_bench.py sets them with `WeightReader.use_bench_switches`). A deployed reader runs
    these defaults."""

    blanket_gc: bool = False  # always gc.collect() at close (the baseline the benchmark compares)
    # One batched copy launch per bucket where Triton and CUDA are there (fastcopy.py).
    copy_kernel: bool = True
    overlap_open: bool = True  # enqueue a bucket's copies as soon as it is open, while the next ones open


@dataclass(frozen=True, slots=True)
class _Copied:
    """What a step's open-and-copy leaves for its ACK (no view of a mapping: the close comes in between)."""

    program: CopyProgram
    nbytes: int  # bytes copied here
    kept: tuple[int, ...]  # buckets read through kept mappings (the ACK's `kept`)
    sums: torch.Tensor | None  # the weights check's sums of what was installed (None: no digest)
    digest_s: float  # host time of the digest's launch


@dataclass(frozen=True, slots=True)
class ReaderSettings:
    job: str
    namespace: str
    replica: int = 0
    rank: int = 0
    step_timeout_s: float = float(env.STEP_TIMEOUT_SECONDS.default)
    heartbeat_ttl_s: float = 10.0
    ready_spin_s: float = env.READY_SPIN_MS.default / 1e3  # poll for a step this long first (_spin_for_step)
    verify_checksums: bool = True  # compare the trainer's sampled checksums when the manifest has some
    allow_extra_entries: bool = False  # entries with no target are an error unless an exchange takes them

    @staticmethod
    def from_config(cfg: ColocateConfig, *, rank: int = 0) -> ReaderSettings:
        return ReaderSettings(
            job=cfg.job,
            namespace=cfg.namespace,
            replica=cfg.replica_index,
            rank=rank,
            step_timeout_s=cfg.step_timeout_s,
            heartbeat_ttl_s=cfg.heartbeat_ttl_s,
            ready_spin_s=cfg.ready_spin_ms / 1e3,
        )


class WeightReader:
    def __init__(
        self,
        store: MetaStore,
        importer: BucketImporter,
        targets: Mapping[str, torch.Tensor],
        settings: ReaderSettings,
        *,
        target_shards: Mapping[str, TensorShard] | None = None,
        exchange: Exchange | None = None,
        finalize: Callable[[], None] | None = None,
        scales: Mapping[str, torch.Tensor] | None = None,
        fp8_format: BlockFp8 = FP32_SCALES,
    ) -> None:
        """`finalize` runs after the copy and the verified close, before the ACK: the engine rebuilds what it
        derives from the weights (SGLang's `post_load_weights`); if it raises, the step fails. `scales`: the
        `weight_scale_inv` of every target the engine holds in block FP8 (e4m3): the trainer's BF16 pieces
        are quantized into it while copied, scales in `fp8_format` (reader_program.compile_program)."""
        self.store = store
        self.importer = importer
        self.targets = dict(targets)
        self.target_shards = dict(target_shards or {})
        self.scales = dict(scales or {})
        self.fp8_format = fp8_format
        self.settings = settings
        self.exchange = exchange
        self.finalize = finalize
        self.uuid = importer.device_uuid()
        # Who this reader instance is; each step's claim adds the digest of a per-step proof (claim_for), and
        # only an ACK carrying that proof frees the trainer's buckets.
        self.identity = reader_identity(host_id(), os.getpid(), secrets.token_hex(6))
        self._secret = secrets.token_bytes(16)
        self._unreleased: list[tuple[int, int, ImportScope]] = []  # failed closes: (gen, step, their scope)
        self.history = UpdateHistory()
        self.gen: int | None = None
        self.last_applied: tuple[int, int] | None = None
        self.weight_version: str | None = None
        self._state = "idle"
        self._heartbeat: Heartbeat | None = None
        self._watch: tuple[int | None, PeerWatch] | None = None
        self._lost_gen: int | None = None
        self._programs = ProgramCache()
        self._layouts = LayoutCache()  # the last checked layout: a repeated one is not decoded again
        self._kept = KeptMappings(importer)  # the trainer's storage kept mapped, where its manifests allow
        self._layout_hash: tuple[tuple[PlacedEntry, ...], str] | None = None
        self._exchange_called: bool | None = None  # None outside a step; else whether this step called it
        self.preflight: PreflightResponder | None = None  # the IPC preflight responder; stopped at close
        # The defaults of ReaderBenchSwitches, fixed here so the step reads no switch (use_bench_switches).
        self._overlap_min_bytes: float = OVERLAP_MIN_BYTES
        self._blanket_gc = False
        self._copy_kernel = True
        for name, shard in self.target_shards.items():
            t = self.targets.get(name)
            if t is None or tuple(t.shape) != shard.box.lengths:
                raise ValueError(f"{name}: target shard {shard.box} does not match the parameter")

    def start(self) -> WeightReader:
        device = self._kernel_device()
        if device is not None:
            fastcopy.warm_up(device)  # compile now rather than in the first step
            digest.warm_up(device)
        self._heartbeat = Heartbeat(
            self.store,
            "reader",
            self.uuid,
            self.settings.heartbeat_ttl_s,
            info=lambda: {"state": self._state, "last": self.last_applied, "rank": self.settings.rank},
        ).start()
        return self

    def use_bench_switches(self, switches: ReaderBenchSwitches) -> None:
        """Benchmark only: bring back the costs `switches` names. Drops the compiled copy programs (the copy
        kernel switch changes them)."""
        self._overlap_min_bytes = OVERLAP_MIN_BYTES if switches.overlap_open else math.inf
        self._blanket_gc = switches.blanket_gc
        self._copy_kernel = switches.copy_kernel
        self._programs = ProgramCache()

    def close(self) -> None:
        self._kept.drop_all("reader closed")
        if self.preflight is not None:
            self.preflight.stop()
            self.preflight = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    # --- waiting for a step -------------------------------------------------------------------------------

    def apply_next(self, timeout_s: float | None = None) -> StepReport:
        """Wait for the next published step on this GPU (of the trainer's current incarnation), apply it."""
        with self._exchange_round():
            return self._apply_next(timeout_s)

    def _apply_next(self, timeout_s: float | None) -> StepReport:
        deadline = Deadline(self.settings.step_timeout_s if timeout_s is None else timeout_s)
        trainer: PeerWatch | None = None
        unreachable: str | None = None
        spin = self.settings.ready_spin_s  # once per call, before the first blocking wait
        while True:
            try:
                gen = self._follow_gen()
                trainer = self._trainer_watch(gen)
                if not trainer.ever_seen:
                    trainer.check()  # until first seen; afterwards only on idle wake-ups
                if gen is not None:
                    reason = self.store.abort_reason(gen, None)
                    if reason is not None:
                        raise StepAborted(f"generation {gen} aborted: {reason}")
                    polled = self._spin_for_step(gen, min(spin, deadline.remaining()))
                    spin = 0.0
                    step, fetched = polled or (self.store.pop_ready(gen, self.uuid, deadline.slice()), None)
                    unreachable = None
                    if step is not None:
                        report = self._try_step(gen, step, fetched)
                        if report is not None:
                            return report
                        continue
                else:
                    time.sleep(deadline.slice(0.2))
                trainer.check()
            except MetaStoreUnavailable as err:
                unreachable = str(err)
                time.sleep(min(0.2, deadline.remaining()))
            lost = trainer is not None and trainer.ever_seen and unreachable is None and trainer.dead()
            if lost and self._lost_gen != self.gen:
                # Said once per incarnation; later calls wait for the restarted trainer's new generation.
                self._lost_gen = self.gen
                self._kept.drop_all("trainer lost")
                raise PeerLost(f"trainer on {self.uuid} stopped heartbeating (generation {self.gen})")
            if deadline.expired:
                if unreachable is not None:
                    raise MetaStoreLost(f"waiting for a step: {unreachable}")
                raise StepTimedOut(f"no step published for {self.uuid} within {deadline.seconds:.1f}s")

    def _spin_for_step(self, gen: int, seconds: float) -> tuple[int, StepFetch | None] | None:
        """Poll this GPU's ready list for `seconds` before blocking on it: a blocked reader and an idle Redis
        server wake on cold cores (bench/hop_bench.py), which a step published within the spin does not pay.
        0: no poll at all (the blocking call takes a step already published as fast). A poll that takes the
        step after the last applied one fetches and claims it too (one round trip less)."""
        if seconds <= 0:
            return None
        expect = self.last_applied[1] + 1 if self.last_applied and self.last_applied[0] == gen else None
        who = "" if expect is None else self.claim_for(gen, expect)
        until = time.perf_counter() + seconds
        while True:
            if expect is None:
                step = self.store.poll_ready(gen, self.uuid)
                polled = None if step is None else (step, None)
            else:
                polled = self.store.poll_step(gen, self.uuid, expect, who)
            if polled is not None or time.perf_counter() >= until:
                return polled

    def _trainer_watch(self, gen: int | None) -> PeerWatch:
        """One watch per incarnation, kept across calls: a trainer seen in an earlier call counts as seen."""
        if self._watch is None or self._watch[0] != gen:
            self._watch = (gen, PeerWatch(self.store, "trainer", self.uuid, self.settings.heartbeat_ttl_s))
        return self._watch[1]

    def _follow_gen(self) -> int | None:
        current = self.store.current_gen(self.uuid)
        if current is not None and (self.gen is None or current > self.gen):
            if self.gen is not None:
                log.info(
                    "trainer restarted: generation %d -> %d; keys of %d are ignored",
                    self.gen,
                    current,
                    self.gen,
                )
                self._kept.drop_all(f"trainer generation {self.gen} ended")
            self.gen = current
        return self.gen

    def _try_step(self, gen: int, step: int, fetched: StepFetch | None = None) -> StepReport | None:
        if self.last_applied is not None and (gen, step) <= self.last_applied:
            # The same generation's steps only grow (the writer refuses otherwise): an applied step notified
            # again. Its trainer already holds the ACK; a manifest passed to apply() is refused instead.
            log.info("step %d of generation %d: already applied, notification skipped", step, gen)
            return None
        # No automatic collection between the notification and the ACK: with a serving process's heap one
        # costs 100+ ms. The forced close still collects explicitly when it must.
        with _automatic_gc_paused():
            return self._fetch_and_apply(gen, step, fetched)

    def _fetch_and_apply(self, gen: int, step: int, fetched: StepFetch | None = None) -> StepReport | None:
        """`fetched`: the step as the spin's poll fetched (and claimed) it already."""
        t0 = time.perf_counter()
        # Manifest, claim and abort keys in one round trip (no claim when the manifest is gone).
        if fetched is None:
            fetched = self.store.fetch_step(gen, step, self.uuid, self.claim_for(gen, step))
        if fetched is None:
            log.warning("step %d of generation %d: manifest expired or lost, skipped", step, gen)
            return None
        if fetched.winner != self.claim_for(gen, step):
            log.warning("step %d: claimed by %s before this reader; skipped", step, fetched.winner)
            return None
        try:
            manifest = decode_manifest(
                fetched.manifest,
                expect_gen=gen,
                expect_step=step,
                expect_gpu=self.uuid,
                cache=self._layouts,
                layouts=lambda ref: self.store.read_layout(gen, self.uuid, ref),
            )
        except ManifestError as err:
            # Nothing was opened: say so at once, so the trainer frees instead of waiting for its timeout.
            ack = Ack(
                status="error",
                ipc_closed=True,
                error=f"ManifestError: {err}",
                reader_pid=os.getpid(),
                reader_host=host_id(),
                **self._signed(gen, step),
                opened=(),
                held=self._held(),
            )
            self.store.write_ack(gen, step, self.uuid, ack)
            raise StepFailed(f"step {step}: {err}", step=step) from None
        return self._apply(manifest, time.perf_counter() - t0, abort=(fetched.abort_reason,))

    # --- one step -----------------------------------------------------------------------------------------

    def apply(self, manifest: Manifest, *, fetch_s: float = 0.0) -> StepReport:
        """Open, copy, close, verify, ACK. The caller must have claimed the step. A step not newer than the
        last applied one is refused (StaleStep) and its trainer told at once."""
        self._refuse_stale(manifest)
        with self._exchange_round():
            return self._apply(manifest, fetch_s)

    def _refuse_stale(self, manifest: Manifest) -> None:
        if self.last_applied is None or (manifest.gen, manifest.step) > self.last_applied:
            return
        gen, step = self.last_applied
        err = StaleStep(
            f"step {manifest.step} of generation {manifest.gen} is not newer than the applied step {step} of "
            f"generation {gen}: refused, the newer weights stay",
            step=manifest.step,
        )
        log.warning("%s", err)
        self._fail(manifest, err, CloseReport(released=True, gc_fallback=False, alive=(), seconds=0.0), {})
        raise err

    def _apply(
        self, manifest: Manifest, fetch_s: float, *, abort: tuple[str | None] | None = None
    ) -> StepReport:
        """`abort`: the abort reason the fetch read with the claim, when it did (saves a round trip)."""
        gen, step = manifest.gen, manifest.step
        self._state = "applying"
        seconds: dict[str, float] = {"fetch": fetch_s} if fetch_s else {}
        scope = ImportScope()
        try:
            copied = self._open_and_copy(manifest, scope, seconds, abort)
        except BaseException as err:
            # The traceback's frames hold views of the mappings: clear them, or the close cannot succeed.
            traceback.clear_frames(err.__traceback__)
            close = scope.close(self.importer.synchronize)
            self._remember_unreleased(gen, step, scope, close)
            self._fail(manifest, err, close, seconds)
            raise
        close = scope.close(self.importer.synchronize, blanket_gc=self._blanket_gc)
        seconds["close"] = close.seconds
        self._remember_unreleased(gen, step, scope, close)
        if not close.released:
            err = CloseError(f"step {step}: buckets {list(close.alive)} still referenced after gc.collect()")
            self._fail(manifest, err, close, seconds)
            raise err
        if self.finalize is not None:
            t1 = time.perf_counter()
            try:
                self.finalize()
            except Exception as err:
                self._fail(manifest, err, close, seconds)
                raise
            seconds["finalize"] = time.perf_counter() - t1
        return self._acknowledge(manifest, copied, close, seconds)

    def _open_and_copy(
        self,
        manifest: Manifest,
        scope: ImportScope,
        seconds: dict[str, float],
        abort: tuple[str | None] | None,
    ) -> _Copied:
        """Open each bucket once (kept ones through their anchors) into `scope` and copy the step into the
        parameters; returns once the device is done. Nothing it returns holds a view of a mapping."""
        gen, step = manifest.gen, manifest.step
        reason = self.store.abort_reason(gen, step) if abort is None else abort[0]
        if reason is not None:
            raise StepAborted(f"step {step} aborted before opening: {reason}", step=step)
        t0 = time.perf_counter()
        # Kept buckets are read through their anchors (opened at the first step that kept them); anchors the
        # manifest no longer keeps are dropped here. The step opens the other buckets itself.
        held = self._kept.hold([b for b in manifest.buckets if b.index in manifest.kept])
        for index, anchor in held.tensors.items():
            scope.borrow(index, anchor, opened=index in held.opened)
        program = self._program(manifest)
        # Open each bucket once; a large bucket's copies are enqueued at once (the device copies bucket i
        # while the host opens bucket i+1); small buckets, whose copies would hide little, are copied after
        # the last open. "open" is the time spent in the open calls, "copy" the rest until the device
        # finished: together the wall time of both.
        open_s = 0.0
        later: list[int] = []
        for b in manifest.buckets:
            if b.index not in held.tensors:
                o0 = time.perf_counter()
                scope.add(b.index, self.importer.open(b.descriptor, b.nbytes))
                open_s += time.perf_counter() - o0
            if b.nbytes >= self._overlap_min_bytes:
                program.copy_bucket(b.index, scope.bucket)
            else:
                later.append(b.index)
        for index in later:
            program.copy_bucket(index, scope.bucket)
        copied = self._copy_rest(manifest, program, scope)
        d0 = time.perf_counter()
        sums = self._digest_launch(manifest, program, scope)  # read before the close, checked after it
        digest_s = time.perf_counter() - d0
        self.importer.synchronize()  # the copy phase ends when the device is done with it
        seconds["open"] = open_s
        seconds["copy"] = time.perf_counter() - t0 - open_s - digest_s
        return _Copied(program, copied, held.indices, sums, digest_s)

    def _acknowledge(
        self, manifest: Manifest, copied: _Copied, close: CloseReport, seconds: dict[str, float]
    ) -> StepReport:
        """Check what landed (the weights digest, sampled checksums), ACK with `ipc_closed`, report."""
        gen, step = manifest.gen, manifest.step
        wrong, mismatches = self._check(manifest, copied, seconds)
        error = _digest_error(step, wrong) if wrong else ""
        if mismatches and not wrong:
            error = f"checksum mismatch: {mismatches}"
        ack = Ack(
            status="error" if mismatches or wrong else "ok",
            ipc_closed=True,
            bytes_copied=copied.nbytes,
            seconds=seconds,
            gc_fallback=close.gc_fallback,
            checksum_mismatches=tuple(mismatches),
            digest_checked=0 if copied.sums is None else len(manifest.entries),
            digest_mismatches=tuple(wrong[:DIGEST_NAMES_MAX]),
            error=error,
            reader_pid=os.getpid(),
            reader_host=host_id(),
            **self._signed(gen, step),
            opened=close.opened,
            held=self._held(),
            kept=copied.kept,
        )
        t3 = time.perf_counter()
        self.last_applied = (gen, step)
        try:
            self._write_ack(manifest, ack)
        except MetaStoreError as err:
            raise MetaStoreLost(
                f"step {step} applied and closed, but its ACK was not written: {err}", step=step
            ) from None
        seconds["ack"] = time.perf_counter() - t3
        self._state = "idle"
        report = StepReport(
            gen,
            step,
            manifest.weight_version,
            copied.nbytes,
            len(manifest.buckets),
            seconds,
            close.gc_fallback,
        )
        phases = [("opened", seconds.get("open", 0.0)), ("copied", seconds.get("copy", 0.0))]
        self._emit(manifest, [*phases, ("closed", close.seconds), ("acked", seconds["ack"])], report, error)
        if wrong:
            raise WeightsMismatch(error, parameters=tuple(wrong), step=step)
        if mismatches:
            raise StepFailed(f"step {step}: sampled checksums differ for {mismatches}", step=step)
        self.weight_version = manifest.weight_version
        self.history.record(UpdateRecord(gen, step, self._hash_of(manifest), copied.nbytes, report.seconds))
        if self.history.layout_changed():
            log.warning("step %d: the trainer's layout changed since the previous update", step)
        return report

    def _check(
        self, manifest: Manifest, copied: _Copied, seconds: dict[str, float]
    ) -> tuple[list[str], list[str]]:
        """The parameters whose installed sample differs from the trainer's digest, and those whose sampled
        checksum differs (each empty when the manifest carries none)."""
        t2 = time.perf_counter()
        wrong: list[str] = []
        if copied.sums is not None and manifest.digest is not None:
            sample = copied.program.digests[manifest.digest.period, manifest.digest.chunk]  # the layout's
            wrong = digest.mismatches(sample.names, sample.finish(copied.sums), manifest.digest.sums)
            seconds["digest"] = copied.digest_s + time.perf_counter() - t2
        t2 = time.perf_counter()
        mismatches = self._verify(manifest) if self.settings.verify_checksums and manifest.checksums else []
        if manifest.checksums:
            seconds["verify"] = time.perf_counter() - t2
        return wrong, mismatches

    @torch.no_grad()
    def _copy_rest(self, manifest: Manifest, program: CopyProgram, scope: ImportScope) -> int:
        """Sharded entries and the exchange, once every bucket is open; returns the bytes copied here."""
        covered, copied_bytes = program.copy_sharded(scope.bucket, self.targets, self.target_shards)
        extra = program.extra
        missing = {n: t for n, t in self.targets.items() if covered.get(n, 0) < t.numel()}
        if extra and self.exchange is None and not self.settings.allow_extra_entries:
            raise CoverageError(
                f"step {manifest.step}: {len(extra)} entries have no parameter here: {sorted(extra)[:8]}",
                step=manifest.step,
            )
        if self.exchange is not None:
            local = {e.name: entry_view(scope.bucket(e.bucket), e) for e in manifest.entries}
            request = ExchangeRequest(
                manifest=manifest,
                local=local,
                local_entries={e.name: e for e in manifest.entries},
                missing=missing,
                missing_boxes={n: self._missing_boxes(n, manifest) for n in missing},
                target_shards=self.target_shards,
            )
            self._exchange_called = True
            filled = self.exchange(request)
            del request, local
            missing = {n: t for n, t in missing.items() if n not in filled}
        if missing:
            raise CoverageError(
                f"step {manifest.step}: {len(missing)} parameters not filled: {sorted(missing)[:8]}",
                step=manifest.step,
            )
        return copied_bytes

    def _program(self, manifest: Manifest) -> CopyProgram:
        """The copy program of a layout, built (and checked) once: layouts repeat from step to step."""
        return self._programs.get(
            manifest,
            lambda m: compile_program(
                m,
                self.targets,
                self.target_shards,
                self._kernel_device(),
                self.scales or None,
                self.fp8_format,
            ),
        )

    def _digest_launch(
        self, manifest: Manifest, program: CopyProgram, scope: ImportScope
    ) -> torch.Tensor | None:
        """The weights check (digest.py): enqueue the hash of this step's sample where this rank installed it
        (after the copies, on the same stream; the copy phase's synchronize waits for both). None: the
        manifest carries no digest."""
        spec = manifest.digest
        if spec is None:
            return None
        sample = program.digests.get((spec.period, spec.chunk))  # the trainer's sample, whatever its version
        if sample is None:
            device = getattr(self.importer, "device", None)
            quantized = frozenset(
                n for n, t in self.targets.items() if t.dtype == torch.float8_e4m3fn and n in self.scales
            )
            sample = digest.reader_program(
                manifest.entries,
                [b.index for b in manifest.buckets],
                self.targets,
                self.target_shards,
                quantized,
                spec.period,
                device if isinstance(device, torch.device) else torch.device("cpu"),
                chunk=spec.chunk,
            )
            program.digests = {(spec.period, spec.chunk): sample}
        return sample.launch(manifest.step, scope.bucket)

    def _hash_of(self, manifest: Manifest) -> str:
        """The layout hash for the history, computed once per layout (a millisecond at 400 entries)."""
        if self._layout_hash is None or self._layout_hash[0] is not manifest.entries:
            self._layout_hash = (manifest.entries, manifest.plan().layout_hash())
        return self._layout_hash[1]

    def _kernel_device(self) -> torch.device | None:
        """The device whose buckets the batched copy kernel copies, or None to copy entry by entry."""
        device = getattr(self.importer, "device", None)
        if not self._copy_kernel or not isinstance(device, torch.device):
            return None
        return device if fastcopy.available(device) else None

    def _missing_boxes(self, name: str, manifest: Manifest) -> tuple[Box, ...]:
        tshard = self.target_shards.get(name)
        box = tshard.box if tshard is not None else Box.full(tuple(self.targets[name].shape))
        owned = [e.shard.box for e in manifest.entries if e.name == name and e.shard is not None]
        if not owned:
            return (box,)
        # One trainer rank owns at most one box per name: what it does not cover is the remainder.
        return box.difference(owned[0])

    def _verify(self, manifest: Manifest) -> list[str]:
        wrong = []
        for name, expected in sorted(manifest.checksums.items()):
            target = self.targets.get(name)
            if target is None or name in self.target_shards or name in self.scales:
                continue  # compared only where the parameter is the whole entry, as sent (not quantized)
            if checksum.tensor_checksum(target) != expected:
                wrong.append(name)
        return wrong

    @contextlib.contextmanager
    def _exchange_round(self) -> Iterator[None]:
        """One step's part in the exchange: if it fails before calling the exchange, abandon it (see
        `Exchange`). Re-entrant: `apply` inside `apply_next` is the same round."""
        if self.exchange is None or self._exchange_called is not None:
            yield
            return
        self._exchange_called = False
        try:
            yield
        except Exception as err:
            abandon = getattr(self.exchange, "abandon", None)
            if not self._exchange_called and abandon is not None:
                try:
                    abandon(err)
                except Exception as abandon_err:  # the step's own error is the one to raise
                    log.error("exchange not told that this step failed: %s", abandon_err)
            raise
        finally:
            self._exchange_called = None

    # --- answers ------------------------------------------------------------------------------------------

    def _write_ack(self, manifest: Manifest, ack: Ack) -> None:
        deadline = Deadline(max(5.0, self.settings.heartbeat_ttl_s))
        while True:
            try:
                self.store.write_ack(manifest.gen, manifest.step, self.uuid, ack)
                return
            except MetaStoreUnavailable:
                if deadline.expired:
                    raise
                time.sleep(0.2)

    def claim_for(self, gen: int, step: int) -> str:
        """This reader's claim value for one step (a caller of `apply` claims the step with it)."""
        return step_claim(self.identity, self._proof(gen, step))

    def _proof(self, gen: int, step: int) -> str:
        # Per step and never stored: an ACK of one step shows nothing that would let anyone forge the next.
        return hmac.new(self._secret, f"{self.uuid}:{gen}:{step}".encode(), hashlib.sha256).hexdigest()[:32]

    def _signed(self, gen: int, step: int) -> dict[str, str]:
        return {"reader": self.claim_for(gen, step), "proof": self._proof(gen, step)}

    def _remember_unreleased(self, gen: int, step: int, scope: ImportScope, close: CloseReport) -> None:
        """A failed close: its mappings live on; later ACKs list the step in `held` until they are gone."""
        if not close.released:
            self._unreleased.append((gen, step, scope))

    def _held(self) -> tuple[tuple[int, int], ...]:
        """Earlier steps whose mappings are still alive here (the trainer keeps their buckets parked)."""
        self._unreleased = [(g, s, scope) for g, s, scope in self._unreleased if scope.alive()]
        return tuple((g, s) for g, s, _ in self._unreleased)

    def _fail(
        self, manifest: Manifest, err: BaseException, close: CloseReport, seconds: dict[str, float]
    ) -> None:
        self._state = "failed"
        seconds = {**seconds, "close": close.seconds}
        ack = Ack(
            status="error",
            ipc_closed=close.released,
            result=err.result if isinstance(err, StepFailed) else "error",
            seconds=seconds,
            gc_fallback=close.gc_fallback,
            error=f"{type(err).__name__}: {err}",
            reader_pid=os.getpid(),
            reader_host=host_id(),
            **self._signed(manifest.gen, manifest.step),
            opened=close.opened,
            held=self._held(),
        )
        try:
            self._write_ack(manifest, ack)
        except MetaStoreError as ack_err:
            log.error("step %d: error ACK not written: %s", manifest.step, ack_err)
        result = err.result if isinstance(err, StepFailed) else "error"
        self._emit_one(
            manifest, "failed", sum(seconds.values()), result=result, error=str(err), phase_seconds=seconds
        )

    def _emit(
        self, manifest: Manifest, phases: list[tuple[str, float]], report: StepReport, error: str
    ) -> None:
        events = [self._event(manifest, phase, s, report.bytes) for phase, s in phases]
        events.append(
            self._event(
                manifest,
                "finished" if not error else "failed",
                report.seconds,
                report.bytes,
                result="ok" if not error else "error",
                phase_seconds=report.phase_seconds,
                error=error,
            )
        )
        try:
            self.store.emit(*events)
        except MetaStoreError as err:
            log.warning("step events not recorded: %s", err)

    def _emit_one(self, manifest: Manifest, phase: str, seconds: float, **kw: object) -> None:
        try:
            self.store.emit(self._event(manifest, phase, seconds, manifest.payload_bytes, **kw))
        except MetaStoreError as err:
            log.warning("step event not recorded: %s", err)

    def _event(
        self,
        manifest: Manifest,
        phase: str,
        seconds: float,
        nbytes: int,
        *,
        result: str = "",
        phase_seconds: Mapping[str, float] | None = None,
        error: object = "",
    ) -> StepEvent:
        source = EventSource("reader", self.settings.replica, self.settings.rank, self.uuid)
        return source.event(
            manifest.gen,
            manifest.step,
            phase,
            result=result,
            seconds=seconds,
            phase_seconds=phase_seconds,
            nbytes=nbytes,
            handles=len(manifest.buckets),
            weight_version=manifest.weight_version,
            error=str(error),
        )


def _digest_error(step: int, wrong: list[str]) -> str:
    shown = wrong[:8]
    more = f" and {len(wrong) - len(shown)} more" if len(wrong) > len(shown) else ""
    return (
        f"step {step}: weights check failed: the installed sample of {len(wrong)} parameter(s) differs from "
        f"what the trainer published: {shown}{more}"
    )


@contextlib.contextmanager
def _automatic_gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
