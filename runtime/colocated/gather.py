"""Reader side of the one-pass update: a gather program from the trainer's storage into the engine's
parameters, compiled once per layout.

Each manifest entry (a packed range, or a strided view of an adopted trainer storage, see inplace.py) is cut
to the part of its target this rank holds; both sides become byte runs in the entry's row-major order and are
cut at each other's boundaries (strided.py). The conversion is folded in: the target of a canonical piece is
already a view of the engine's fused parameter (q/k/v rows inside `qkv_proj`, an expert inside `w13_weight`,
the real rows of a padded vocabulary), and a source view already undoes Megatron's interleaving. So a step is
one kernel launch per source storage (fastcopy.py's tile kernel), at device-copy speed.

Segments the kernel cannot take (unaligned, no Triton, CPU) are copied entry by entry with torch, through
integer views so that every bit pattern survives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from colocate_runtime.bits import bits
from colocate_runtime.colocated import fastcopy, strided
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.views import entry_view
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard


@dataclass(frozen=True, slots=True)
class SlowCopy:
    """One entry's part copied with torch: the entry's sub-box `part` into `dst`."""

    entry: PlacedEntry
    part: Box  # in the entry's own coordinates
    dst: torch.Tensor


@dataclass(slots=True)
class GatherProgram:
    tables: dict[int, fastcopy.TileTable] = field(default_factory=dict)  # bucket -> its kernel launch
    slow: list[SlowCopy] = field(default_factory=list)
    covered: dict[str, int] = field(default_factory=dict)  # elements of each target written
    copied_bytes: int = 0

    def launch(self, index: int, flat: torch.Tensor) -> None:
        """Enqueue the kernel copies out of bucket `index` (this step's mapping)."""
        table = self.tables.get(index)
        if table is not None:
            table.launch(flat)

    def copy_slow(self, bucket: Callable[[int], torch.Tensor]) -> None:
        for c in self.slow:
            source = entry_view(bucket(c.entry.bucket), c.entry)
            bits(c.dst).copy_(bits(source)[c.part.slices()])


def compile_gather(
    entries: tuple[PlacedEntry, ...],
    targets: Mapping[str, torch.Tensor],
    target_shards: Mapping[str, TensorShard],
    device: torch.device | None,
) -> GatherProgram:
    """`device`: where the batched kernel runs (None: every copy goes through torch)."""
    program = GatherProgram()
    rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    bases: dict[int, torch.Tensor] = {}
    keep: dict[int, list[torch.Tensor]] = {}
    for e in entries:
        target = targets.get(e.name)
        if target is None:
            continue
        tshard = target_shards.get(e.name)
        src_box = e.shard.box if e.shard is not None else Box.full(e.shape)
        dst_box = tshard.box if tshard is not None else Box.full(tuple(target.shape))
        if (
            e.shard is None and tshard is None and tuple(target.shape) != e.shape
        ) or src_box.ndim != dst_box.ndim:
            raise ValueError(
                f"{e.name}: trainer sent {list(e.shape)}, the parameter has {list(target.shape)}"
            )
        common = src_box.intersect(dst_box)
        if common is None:
            continue
        part = common.relative_to(src_box)
        dst = target[common.relative_to(dst_box).slices()]
        program.covered[e.name] = program.covered.get(e.name, 0) + common.numel
        program.copied_bytes += common.numel * target.element_size()
        if device is None or dst.device != device:
            program.slow.append(SlowCopy(e, part, dst))
            continue
        s, d, n = strided.segments(_source_runs(e, part), _runs_of(dst))
        aligned = bool(
            ((s % fastcopy.VECTOR == 0) & (d % fastcopy.VECTOR == 0) & (n % fastcopy.VECTOR == 0)).all()
        )
        if not aligned:
            program.slow.append(SlowCopy(e, part, dst))
            continue
        if e.bucket not in bases:
            bases[e.bucket] = torch.empty(0, dtype=torch.uint8, device=device).set_(dst.untyped_storage())
        rows.setdefault(e.bucket, []).append((s, d - bases[e.bucket].data_ptr(), n))
        keep.setdefault(e.bucket, []).append(target)
    for index, parts in rows.items():
        s, d, n = (torch.cat(col) for col in zip(*parts, strict=True))
        ts, td, tn = strided.tiles(s, d, n, fastcopy.TILE_BYTES)
        table = torch.stack([ts, td, tn], dim=1).contiguous().to(device)
        program.tables[index] = fastcopy.TileTable(
            table, bases[index], tuple(keep[index]), int(ts.numel()), int(n.sum())
        )
    return program


def _source_runs(e: PlacedEntry, part: Box) -> strided.Runs:
    """Bytes of the entry's sub-box `part` in its bucket, in the sub-box's row-major order."""
    esize = DTYPE_BYTES[e.dtype]
    ranges = strided.box_ranges(e.shape, part.offsets, part.lengths, esize)
    if e.view is None:  # packed contiguously: logical position = address
        return ranges[0] + e.offset, ranges[1]
    shape, strides = e.view
    whole = strided.runs(e.offset, shape, strides, esize)
    return whole if part == Box.full(e.shape) else strided.select(whole, ranges)


def _runs_of(dst: torch.Tensor) -> strided.Runs:
    return strided.runs(dst.data_ptr(), tuple(dst.shape), tuple(dst.stride()), dst.element_size())
