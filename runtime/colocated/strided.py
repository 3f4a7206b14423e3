"""Strided regions as contiguous byte runs, and the copy segments between two of them (pure, vectorised).

Why: the one-pass update copies straight from the trainer's own parameter storage into SGLang's fused
parameters. Either side may be a strided view (Megatron's interleaved q/k/v groups, a column shard of a
row-parallel weight), so a copy is described by both sides' byte runs in the same logical (row-major) order;
cutting both at each other's boundaries gives segments that are contiguous on both sides, which one kernel
launch per source storage copies (fastcopy.py). Everything here is computed once per layout.

Runs are two int64 tensors, `addr` and `length` (bytes), in logical order. Addresses are relative to
whatever base the caller chose (a mapping's start for sources, a device address for destinations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Runs = tuple[torch.Tensor, torch.Tensor]  # (addr, length), int64, logical order


def runs(offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> Runs:
    """Byte runs of the view `as_strided(shape, strides, offset)` (offset in bytes, strides in elements),
    adjacent runs merged: a contiguous view is one run."""
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides {tuple(strides)} are not supported")
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    if any(n == 0 for n, _ in dims):
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    # The innermost block that is contiguous in memory becomes one run.
    block = 1
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    addr = torch.tensor([offset], dtype=torch.int64)
    for n, s in dims:  # outer dimensions, outermost first: row-major order of the runs
        addr = (addr[:, None] + torch.arange(n, dtype=torch.int64)[None, :] * (s * itemsize)).reshape(-1)
    length = torch.full_like(addr, block * itemsize)
    return merge(addr, length)


def merge(addr: torch.Tensor, length: torch.Tensor) -> Runs:
    """Join runs that continue where the previous one ended."""
    if addr.numel() <= 1:
        return addr, length
    starts = torch.ones_like(addr, dtype=torch.bool)
    starts[1:] = addr[1:] != addr[:-1] + length[:-1]
    group = torch.cumsum(starts.to(torch.int64), 0) - 1
    merged_len = torch.zeros(int(group[-1]) + 1, dtype=torch.int64).index_add_(0, group, length)
    return addr[starts], merged_len


def total(r: Runs) -> int:
    return int(r[1].sum())


def select(source: Runs, ranges: Runs) -> Runs:
    """The runs of `source` that hold the logical byte ranges `ranges` (pairs of logical start and length,
    increasing), in order: how a sub-box of a piece maps onto the piece's own strided storage."""
    s_addr, s_len = source
    r_start, r_len = ranges
    s_pos = torch.cumsum(s_len, 0) - s_len  # logical start of each source run
    cuts = torch.unique(torch.cat([s_pos, s_pos + s_len, r_start, r_start + r_len]))
    seg_start, seg_len = cuts[:-1], cuts[1:] - cuts[:-1]
    # Keep the segments that lie inside a requested range.
    ri = torch.searchsorted(r_start, seg_start, right=True) - 1
    inside = (ri >= 0) & (seg_start < (r_start + r_len)[ri.clamp(min=0)])
    seg_start, seg_len = seg_start[inside], seg_len[inside]
    si = torch.searchsorted(s_pos, seg_start, right=True) - 1
    if seg_start.numel() and (si.min() < 0 or int((seg_start + seg_len).max()) > total(source)):
        raise ValueError("a requested range lies outside the source")
    return merge(s_addr[si] + (seg_start - s_pos[si]), seg_len)


def segments(src: Runs, dst: Runs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut two run lists covering the same number of bytes at each other's boundaries: the (source address,
    destination address, length) of pieces contiguous on both sides, in logical order."""
    if total(src) != total(dst):
        raise ValueError(f"source holds {total(src)} bytes, destination {total(dst)}")
    s_pos = torch.cumsum(src[1], 0) - src[1]
    d_pos = torch.cumsum(dst[1], 0) - dst[1]
    cuts = torch.unique(torch.cat([s_pos, d_pos, torch.tensor([total(src)], dtype=torch.int64)]))
    start, length = cuts[:-1], cuts[1:] - cuts[:-1]
    si = torch.searchsorted(s_pos, start, right=True) - 1
    di = torch.searchsorted(d_pos, start, right=True) - 1
    return src[0][si] + (start - s_pos[si]), dst[0][di] + (start - d_pos[di]), length


def box_ranges(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int) -> Runs:
    """Logical byte ranges (start, length) of a sub-box of a row-major tensor of `shape`."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    strides.reverse()
    start = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize
    return runs(start, lengths, strides, itemsize)


def tiles(
    src: torch.Tensor, dst: torch.Tensor, length: torch.Tensor, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments cut into pieces of at most `tile` bytes (the batched kernel's unit of work)."""
    count = (length + tile - 1) // tile
    index = torch.repeat_interleave(torch.arange(length.numel()), count)
    first = torch.cumsum(count, 0) - count
    within = (torch.arange(index.numel()) - first[index]) * tile
    return src[index] + within, dst[index] + within, torch.minimum(length[index] - within, torch.tensor(tile))
