"""The reader's copy program: what one layout's step copies out of the mapped buckets into the parameters,
compiled once per layout and run every step (reader.py keeps the step protocol around it).

Compiling sorts a manifest's entries by how they are copied: whole-parameter entries become one split per
bucket (and one batched kernel launch for those fastcopy.py can take), sharded entries copy the intersection
of the trainer's box with the parameter's, an in-place layout is one gather program (gather.py), and entries
with no parameter here are left to the exchange. Layouts repeat from step to step, so `ProgramCache` keeps the
last few programs by layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from colocate_runtime.colocated import fastcopy
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.digest import SampleProgram
from colocate_runtime.colocated.fp8_block import BlockFp8
from colocate_runtime.colocated.fp8_copy import FP32_SCALES
from colocate_runtime.colocated.gather import GatherProgram, compile_gather
from colocate_runtime.colocated.manifest import BucketRecord, Manifest
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.views import dtype_name, entry_view
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard

Bucket = Callable[[int], torch.Tensor]  # a bucket's index -> this step's mapping of it (flat bytes)


@dataclass(slots=True)
class BucketProgram:
    index: int
    dtype: torch.dtype
    sizes: list[int]  # split sizes in elements, covering the whole bucket (padding included)
    copies: list[tuple[int, torch.Tensor, tuple[int, ...] | None]]  # chunk, destination, shape if strided
    table: fastcopy.TileTable | None = None  # the entries the batched kernel copies (not in `copies`)


@dataclass(slots=True)
class CopyProgram:
    buckets: dict[int, BucketProgram] = field(default_factory=dict)
    sharded: list[PlacedEntry] = field(default_factory=list)
    extra: dict[str, PlacedEntry] = field(default_factory=dict)  # entries with no parameter here
    covered: dict[str, int] = field(default_factory=dict)  # elements of each parameter the buckets fill
    copied_bytes: int = 0
    gather: GatherProgram | None = None  # an in-place step: every local copy (gather.py)
    fp8: GatherProgram | None = None  # a packed step's block-FP8 targets, quantized while copied (gather.py)
    # The weights check's sample of this layout, by the trainer's period (digest.py): built at its first step.
    digests: dict[tuple[int, int], SampleProgram] = field(default_factory=dict)  # (period, chunk)

    @torch.no_grad()
    def copy_bucket(self, index: int, bucket: Bucket) -> None:
        """Enqueue the whole-parameter entries of one bucket: one kernel launch for those it can take, then
        one split (a single call makes every remaining entry's view) and one copy per remaining entry."""
        if self.gather is not None:
            self.gather.launch(index, bucket(index))
            return
        if self.fp8 is not None:
            self.fp8.launch(index, bucket(index))
        bp = self.buckets.get(index)
        if bp is None:
            return
        flat = bucket(index)
        if bp.table is not None:
            bp.table.launch(flat)
        if bp.copies:
            chunks = flat.view(bp.dtype).split(bp.sizes)
            for chunk_index, dst, shape in bp.copies:
                src = chunks[chunk_index]
                dst.copy_(src if shape is None else src.view(shape))
            del chunks
        del flat

    @torch.no_grad()
    def copy_sharded(
        self, bucket: Bucket, targets: Mapping[str, torch.Tensor], target_shards: Mapping[str, TensorShard]
    ) -> tuple[dict[str, int], int]:
        """The copies that need every bucket open (sharded entries, the gather's slow part). Returns the
        elements of each parameter filled by the whole step's local copy, and its bytes."""
        plan = _CopyPlan(covered=dict(self.covered), copied_bytes=self.copied_bytes)
        if self.gather is not None:
            self.gather.copy_slow(bucket)
        if self.fp8 is not None:
            self.fp8.copy_slow(bucket)
        for e in self.sharded:
            _plan_entry(e, entry_view(bucket(e.bucket), e), targets[e.name], target_shards.get(e.name), plan)
        for dst, src in zip(plan.direct_dst, plan.direct_src, strict=True):
            dst.copy_(src)
        plan.direct_dst.clear()
        plan.direct_src.clear()
        return plan.covered, plan.copied_bytes


@dataclass(slots=True)
class _CopyPlan:
    direct_dst: list[torch.Tensor] = field(default_factory=list)
    direct_src: list[torch.Tensor] = field(default_factory=list)
    covered: dict[str, int] = field(default_factory=dict)
    copied_bytes: int = 0


class ProgramCache:
    """The copy programs of the last few layouts: a repeated layout is neither compiled nor checked again."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._programs: dict[tuple, CopyProgram] = {}
        self._last: tuple[tuple[PlacedEntry, ...], tuple, CopyProgram] | None = None

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, manifest: Manifest, compile_: Callable[[Manifest], CopyProgram]) -> CopyProgram:
        sizes = tuple((b.index, b.dtype, b.nbytes) for b in manifest.buckets)
        last = self._last
        if last is not None and last[0] is manifest.entries and last[1] == sizes:
            return last[2]  # the layout cache handed back the very entries of the last step
        key = (
            sizes,
            tuple(
                (e.name, e.dtype, e.shape, e.bucket, e.offset, e.nbytes, e.shard, e.view)
                for e in manifest.entries
            ),
        )
        program = self._programs.get(key)
        if program is None:
            program = compile_(manifest)
            if len(self._programs) >= self.size:
                self._programs.clear()
            self._programs[key] = program
        self._last = (manifest.entries, sizes, program)
        return program


def compile_program(
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    target_shards: Mapping[str, TensorShard],
    device: torch.device | None,
    scales: Mapping[str, torch.Tensor] | None = None,
    fmt: BlockFp8 = FP32_SCALES,
) -> CopyProgram:
    """Check a layout against the parameters and compile its copies. `device`: where the batched copy kernel
    runs (None: every copy goes through torch). `scales`: the `weight_scale_inv` view of every target SGLang
    holds in block FP8 (e4m3): its BF16 entries are quantized while copied (gather.py), with scales in `fmt`.
    Raises StepFailed naming the first entry that cannot land."""
    program = CopyProgram()
    direct: dict[int, list[PlacedEntry]] = {}
    in_place = any(e.view is not None for e in manifest.entries)
    gathered: list[PlacedEntry] = []
    quantized: list[PlacedEntry] = []
    for e in manifest.entries:
        target = targets.get(e.name)
        if target is None:
            program.extra[e.name] = e
            continue
        _check_global_shape(e, target_shards.get(e.name), manifest.step)
        if target.dtype == torch.float8_e4m3fn and scales is not None and e.name in scales:
            (gathered if in_place else quantized).append(e)
            continue
        if dtype_name(target.dtype) != e.dtype:
            raise StepFailed(
                f"{e.name}: trainer sent {e.dtype}, the parameter is {dtype_name(target.dtype)}; "
                "the converter must emit the receiver's dtype",
                step=manifest.step,
            )
        if in_place:
            gathered.append(e)
            continue
        if e.shard is not None or e.name in target_shards:
            program.sharded.append(e)
            continue
        if tuple(target.shape) != e.shape:
            raise StepFailed(
                f"{e.name}: trainer sent shape {list(e.shape)}, the parameter has "
                f"{list(target.shape)} (no shard boxes to reconcile them)",
                step=manifest.step,
            )
        direct.setdefault(e.bucket, []).append(e)
        program.covered[e.name] = program.covered.get(e.name, 0) + target.numel()
        program.copied_bytes += e.nbytes
    if in_place or quantized:
        try:
            gather = compile_gather(
                tuple(gathered if in_place else quantized), targets, target_shards, device, scales, fmt
            )
        except ValueError as err:
            raise StepFailed(str(err), step=manifest.step) from None
        if in_place:
            program.gather = gather
            program.covered = dict(gather.covered)
            program.copied_bytes = gather.copied_bytes
            return program
        program.fp8 = gather
        for name, n in gather.covered.items():
            program.covered[name] = program.covered.get(name, 0) + n
        program.copied_bytes += gather.copied_bytes
    for b in manifest.buckets:
        entries = sorted(direct.get(b.index, ()), key=lambda e: e.offset)
        if entries:
            program.buckets[b.index] = _bucket_program(b, entries, targets, device)
    return program


def _check_global_shape(e: PlacedEntry, tshard: TensorShard | None, step: int) -> None:
    """With shard boxes on the engine's side, only the overlap of the two boxes is copied: a parameter the
    trainer sent in another shape would land in part and pass. Both sides' boxes are in canonical coordinates,
    so their global shapes must be the same."""
    if tshard is None:
        return
    sent = e.shard.global_shape if e.shard is not None else e.shape
    if tuple(sent) != tuple(tshard.global_shape):
        raise StepFailed(
            f"{e.name}: trainer sent a parameter of shape {list(sent)}, the engine's is "
            f"{list(tshard.global_shape)}",
            step=step,
        )


def _bucket_program(
    b: BucketRecord,
    entries: list[PlacedEntry],
    targets: Mapping[str, torch.Tensor],
    device: torch.device | None,
) -> BucketProgram:
    """One bucket's whole-parameter copies (`entries` by offset): the batched kernel's table for those it can
    take, and one split covering the bucket (padding included) whose chunks the rest copy from."""
    dtype = torch_dtype(b.dtype)
    esize = DTYPE_BYTES[b.dtype]
    bp = BucketProgram(b.index, dtype, [], [])
    if device is not None:
        fast = [e for e in entries if fastcopy.eligible(targets[e.name], e.nbytes, e.offset, device)]
        if len(fast) >= 2:  # for one entry a copy_ is one launch too, and a cheaper one
            bp.table = fastcopy.build([(e.offset, targets[e.name], e.nbytes) for e in fast], device)
            taken = {id(e) for e in fast}
            entries = [e for e in entries if id(e) not in taken]
    pos = 0
    for e in entries:
        start = e.offset // esize
        if start > pos:
            bp.sizes.append(start - pos)  # alignment padding
        target = targets[e.name]
        contiguous = target.is_contiguous()
        bp.copies.append(
            (
                len(bp.sizes),
                target.view(-1) if contiguous else target,
                None if contiguous else e.shape,
            )
        )
        bp.sizes.append(e.nbytes // esize)
        pos = start + e.nbytes // esize
    if pos < b.nbytes // esize:
        bp.sizes.append(b.nbytes // esize - pos)
    return bp


def _plan_entry(
    e: PlacedEntry, view: torch.Tensor, target: torch.Tensor, tshard: TensorShard | None, plan: _CopyPlan
) -> None:
    if e.shard is None and tshard is None:
        if tuple(target.shape) != e.shape:
            raise StepFailed(
                f"{e.name}: trainer sent shape {list(e.shape)}, the parameter has "
                f"{list(target.shape)} (no shard boxes to reconcile them)"
            )
        plan.direct_dst.append(target)
        plan.direct_src.append(view)
        plan.covered[e.name] = plan.covered.get(e.name, 0) + target.numel()
        plan.copied_bytes += e.nbytes
        return
    # Sharded: copy the intersection of what the trainer holds and what this parameter needs.
    src_box = e.shard.box if e.shard is not None else Box.full(e.shape)
    dst_box = tshard.box if tshard is not None else Box.full(tuple(target.shape))
    common = src_box.intersect(dst_box)
    if common is None:
        return
    src = view[common.relative_to(src_box).slices()]
    dst = target[common.relative_to(dst_box).slices()]
    if src_box == dst_box:
        plan.direct_dst.append(dst)
        plan.direct_src.append(src)
    else:
        dst.copy_(src)
    plan.covered[e.name] = plan.covered.get(e.name, 0) + common.numel
    plan.copied_bytes += common.numel * target.element_size()
