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

Block-FP8 targets (issue 31): a target whose parameter is float8_e4m3fn, with its `weight_scale_inv` view in
`scales`, is quantized while copied: each 128x128 block of the target is read from the BF16 entry and written
as e4m3 with its fp32 scale (fp8_copy.py's kernel, one launch per bucket; fp8_block.quantize on the torch
path), bit-equal to the reference quantizer. Every block must lie whole inside one entry (the trainer's shard
boundaries on multiples of 128); a block cut by a shard boundary is refused for now (the plan: gather those
blocks in BF16 into a scratch buffer, then quantize it as one source).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from colocate_runtime.bits import bits
from colocate_runtime.colocated import fastcopy, fp8_block, fp8_copy, strided
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.views import entry_view, indexed
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard


@dataclass(frozen=True, slots=True)
class SlowCopy:
    """One entry's part copied with torch: the entry's sub-box `part` into `dst`."""

    entry: PlacedEntry
    part: Box  # in the entry's own coordinates
    dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class SlowQuantize:
    """One entry's part quantized with torch into an FP8 target's whole blocks and their scales."""

    entry: PlacedEntry
    part: Box
    dst: torch.Tensor  # e4m3
    scale: torch.Tensor  # fp32, the blocks of `dst`


@dataclass(slots=True)
class GatherProgram:
    tables: dict[int, fastcopy.TileTable] = field(default_factory=dict)  # bucket -> its kernel launch
    slow: list[SlowCopy] = field(default_factory=list)
    covered: dict[str, int] = field(default_factory=dict)  # elements of each target written
    copied_bytes: int = 0
    fp8_tables: dict[int, fp8_copy.BlockTable] = field(default_factory=dict)  # bucket -> quantizing launch
    slow_fp8: list[SlowQuantize] = field(default_factory=list)
    fmt: fp8_block.BlockFp8 = fp8_copy.FP32_SCALES

    def launch(self, index: int, flat: torch.Tensor) -> None:
        """Enqueue the kernel copies out of bucket `index` (this step's mapping)."""
        table = self.tables.get(index)
        if table is not None:
            table.launch(flat)
        quantize = self.fp8_tables.get(index)
        if quantize is not None:
            quantize.launch(flat.view(torch.bfloat16))

    def copy_slow(self, bucket: Callable[[int], torch.Tensor]) -> None:
        for c in self.slow:
            source = entry_view(bucket(c.entry.bucket), c.entry)
            bits(c.dst).copy_(bits(source)[c.part.slices()])
        for q in self.slow_fp8:
            source = entry_view(bucket(q.entry.bucket), q.entry)[q.part.slices()]
            weight, scale = fp8_block.quantize(source.to(q.dst.device), self.fmt)
            q.dst.view(torch.uint8).copy_(weight.view(torch.uint8))
            q.scale.view(torch.int32).copy_(scale.view(torch.int32))


def compile_gather(
    entries: tuple[PlacedEntry, ...],
    targets: Mapping[str, torch.Tensor],
    target_shards: Mapping[str, TensorShard],
    device: torch.device | None,
    scales: Mapping[str, torch.Tensor] | None = None,
    fmt: fp8_block.BlockFp8 = fp8_copy.FP32_SCALES,
) -> GatherProgram:
    """`device`: where the batched kernel runs (None: every copy goes through torch). `scales`: for each
    target held in block FP8 (an e4m3 view), the view of its `weight_scale_inv` covering the target's blocks
    (the target starts on a block boundary of its parameter); `fmt`: their scale format."""
    device = indexed(device)
    program = GatherProgram(fmt=fmt)
    fp8_blocks: dict[int, list[fp8_copy.Block]] = {}
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
        if target.dtype == torch.float8_e4m3fn:
            _plan_fp8(
                e, part, common.relative_to(dst_box), target, (scales or {}).get(e.name), device, program
            )
            if device is not None and target.device == device:
                fp8_blocks.setdefault(e.bucket, []).extend(
                    _fp8_blocks(e, part, common.relative_to(dst_box), target, scales[e.name], fmt.block)
                )
            continue
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
    for index, blocks in fp8_blocks.items():
        assert device is not None
        program.fp8_tables[index] = fp8_copy.build(blocks, device, fmt)
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


def _block_range(start: int, length: int, size: int, block: int, what: str) -> range:
    """The target's blocks [start, start + length) covers; it must cover them whole (a ragged last block
    counts whole when the range reaches the target's end)."""
    end = start + length
    if start % block or (end % block and end != size):
        raise ValueError(
            f"{what} {start}..{end} of {size} cut a {block}-block: a trainer shard boundary inside a block "
            "(block-FP8 targets need 128-aligned trainer shards; a BF16 scratch gather is not implemented)"
        )
    return range(start // block, -(-end // block))


def _plan_fp8(
    e: PlacedEntry,
    part: Box,
    dst_part: Box,
    target: torch.Tensor,
    scale: torch.Tensor | None,
    device: torch.device | None,
    program: GatherProgram,
) -> None:
    """Check an FP8 target's part, count it, and keep the torch path's copy when the kernel cannot run."""
    if e.dtype != "bfloat16":
        raise ValueError(
            f"{e.name}: the parameter is float8_e4m3fn, the trainer sent {e.dtype} (not bfloat16)"
        )
    if scale is None:
        raise ValueError(f"{e.name}: the parameter is float8_e4m3fn and no weight_scale_inv view was given")
    if target.dim() != 2 or dst_part.ndim != 2:
        raise ValueError(f"{e.name}: block-FP8 targets are 2-D views, not {tuple(target.shape)}")
    bm, bk = program.fmt.block
    if tuple(scale.shape) != fp8_block.scale_shape(tuple(target.shape), program.fmt.block):
        raise ValueError(
            f"{e.name}: scale view {tuple(scale.shape)} does not match target {tuple(target.shape)}"
        )
    rows = _block_range(dst_part.offsets[0], dst_part.lengths[0], target.shape[0], bm, f"{e.name}: rows")
    cols = _block_range(dst_part.offsets[1], dst_part.lengths[1], target.shape[1], bk, f"{e.name}: columns")
    program.covered[e.name] = program.covered.get(e.name, 0) + dst_part.numel
    program.copied_bytes += dst_part.numel + 4 * len(rows) * len(cols)
    if device is None or target.device != device:
        dst = target[dst_part.slices()]
        program.slow_fp8.append(
            SlowQuantize(e, part, dst, scale[rows.start : rows.stop, cols.start : cols.stop])
        )


def _row_addresses(e: PlacedEntry, rows: range) -> list[int]:
    """Element offsets in the bucket of the entry's rows (2-D entry, each row's columns contiguous)."""
    if len(e.shape) != 2:
        raise ValueError(f"{e.name}: block-FP8 sources are 2-D entries, not {list(e.shape)}")
    base = e.offset // 2
    ncols = e.shape[1]
    if e.view is None:
        return [base + r * ncols for r in rows]
    shape, strides = e.view
    if shape[-1] != ncols or strides[-1] != 1:
        raise ValueError(f"{e.name}: the trainer's view {shape}/{strides} does not keep rows contiguous")
    out = []
    for r in rows:
        addr, rest = base, r
        for n, st in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
            addr += (rest % n) * st
            rest //= n
        out.append(addr)
    return out


def _fp8_blocks(
    e: PlacedEntry,
    part: Box,
    dst_part: Box,
    target: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
) -> list[fp8_copy.Block]:
    """The kernel's blocks for one entry's part of an FP8 target: each block's source rows must be evenly
    spaced in the bucket (true for every layout whose shard boundaries fall on whole blocks)."""
    bm, bk = block
    r0, c0 = dst_part.offsets
    out = []
    for bi in _block_range(r0, dst_part.lengths[0], target.shape[0], bm, e.name):
        tr = range(bi * bm, min((bi + 1) * bm, target.shape[0]))
        src_rows = range(part.offsets[0] + tr.start - r0, part.offsets[0] + tr.stop - r0)
        addrs = _row_addresses(e, src_rows)
        stride = addrs[1] - addrs[0] if len(addrs) > 1 else 0
        if any(b - a != stride for a, b in itertools.pairwise(addrs)):
            raise ValueError(
                f"{e.name}: the rows of block {bi} are not evenly spaced in the trainer's storage"
            )
        for bj in _block_range(c0, dst_part.lengths[1], target.shape[1], bk, e.name):
            tc = range(bj * bk, min((bj + 1) * bk, target.shape[1]))
            col = part.offsets[1] + tc.start - c0
            out.append(
                fp8_copy.Block(
                    addrs[0] + col, stride, target[tr.start : tr.stop, tc.start : tc.stop], scale[bi, bj]
                )
            )
    return out
