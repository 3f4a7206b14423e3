"""Quantize while copying: BF16 source blocks into an engine's block-FP8 parameters (e4m3 weight + fp32
`weight_scale_inv`), one Triton program per 128x128 block (fp8_kernel.py), bit-equal to fp8_block.quantize.

A `BlockTable` is built once per layout, like fastcopy's tile table: per target block, where its BF16 rows
start in the source (element offset, row stride; each row's columns contiguous), where its e4m3 rows go and
where its scale goes (byte offsets from one base parameter: CUDA's unified address space, as fastcopy.py), and
its real rows and columns (edge blocks are ragged). The source's own address is the launch argument, so a new
mapping of the same bucket each step costs nothing to re-plan.

Every block must come whole from one source with a per-row contiguous layout: true when the trainer's shard
boundaries fall on multiples of 128 (Qwen3 and Qwen3-MoE at our presets: head_dim 128, hidden and
intermediate sizes multiples of 128 x TP). A block that straddles sources (a trainer TP boundary that cuts a
block) is first gathered in BF16 into a scratch buffer (the ordinary copy path), then quantized from the
scratch as one whole-block source: fp8_copy never sees a split block.

The kernel runs on CUDA, and on CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from colocate_runtime.colocated.fp8_block import BLOCK, BlockFp8
from colocate_runtime.colocated.views import indexed

log = logging.getLogger(__name__)

# 16 warps and the GPU's own e4m3 conversion (cvt.rn.satfinite, what torch's cast runs on CUDA): on the H200
# one A3B layer's experts in 0.62 ms against 0.79 ms for the best integer-rounding variant (8 warps), the
# whole-model FP8 step at 0.98 x the BF16 one (bench/fp8_copy_bench.py, step_bench.py; docs/fp8.md). Both
# are bit-equal to fp8_block.quantize on every bf16 value (tests/runtime/test_fp8_copy_gpu.py runs both); the
# CPU interpreter always runs the integer rounding.
WARPS = 16
NATIVE_CAST = True
FP32_SCALES = BlockFp8()  # the default: fp32 scales (SGLang on Hopper)


@functools.cache
def _interpreted() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) has no native e4m3 conversion worth trusting."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _kernel_module() -> ModuleType | None:
    try:
        from colocate_runtime.colocated import fp8_kernel
    except ImportError as err:
        log.info("FP8 quantize-on-copy kernel unavailable (%s)", err)
        return None
    return fp8_kernel


def available() -> bool:
    return _kernel_module() is not None


@dataclass(frozen=True, slots=True)
class Block:
    """One target block: its BF16 source rows and its e4m3 / scale destinations."""

    src_offset: int  # elements from the source base to the block's first element
    src_row_stride: int  # elements between the block's rows in the source
    q: torch.Tensor  # e4m3 [rows, cols] view of the weight, columns contiguous
    scale: torch.Tensor  # fp32 0-d view: the block's weight_scale_inv entry


@dataclass(slots=True)
class BlockTable:
    # int64 [n, 8] tables on the device: blocks BK wide with 16-byte aligned rows (vector accesses, no column
    # mask), then the rest (edge blocks, odd offsets); either may be None
    full: torch.Tensor | None
    ragged: torch.Tensor | None
    dst_base: torch.Tensor  # uint8 view of the first destination; offsets in `table` are bytes from it
    keep: tuple[torch.Tensor, ...]  # every destination, so no address in `table` is freed under it
    nblocks: int
    fmt: BlockFp8
    src_bytes: int  # BF16 bytes read per launch
    dst_bytes: int  # e4m3 + scale bytes written per launch

    def launch(self, src: torch.Tensor) -> None:
        """Enqueue the quantizing copies on the current stream. `src`: this step's BF16 source (flat or any
        shape: only its address and dtype matter)."""
        if src.dtype != torch.bfloat16 or src.device != self.dst_base.device:
            raise TypeError(
                f"source must be bfloat16 on {self.dst_base.device}, got {src.dtype} on {src.device}"
            )
        kernel = _kernel_module()
        assert kernel is not None
        for table, full in ((self.full, True), (self.ragged, False)):
            if table is None:
                continue
            kernel.quantize_blocks[(table.shape[0],)](
                src,
                self.dst_base,
                table,
                self.fmt.amax_floor,
                UE8M0=self.fmt.ue8m0,
                BM=self.fmt.block[0],
                BK=self.fmt.block[1],
                FULL=full,
                NATIVE=NATIVE_CAST and not _interpreted(),
                num_warps=WARPS,
            )


def build(blocks: Sequence[Block], device: torch.device, fmt: BlockFp8 = FP32_SCALES) -> BlockTable:
    if not blocks:
        raise ValueError("no blocks")
    device = indexed(device)  # type: ignore[assignment]  (never None here)
    bm, bk = fmt.block
    base = blocks[0].q
    base_ptr = base.data_ptr()
    full: list[tuple[int, ...]] = []
    ragged: list[tuple[int, ...]] = []
    keep: dict[int, torch.Tensor] = {}
    src_bytes = dst_bytes = 0
    for b in blocks:
        if b.q.dtype != torch.float8_e4m3fn or b.scale.dtype != torch.float32 or b.scale.dim() != 0:
            raise TypeError(
                f"a block needs an e4m3 view and a 0-d fp32 scale, not {b.q.dtype} / {b.scale.dtype}"
            )
        if (
            b.q.dim() != 2
            or b.q.shape[0] > bm
            or b.q.shape[1] > bk
            or (b.q.shape[1] > 1 and b.q.stride(1) != 1)
        ):
            raise ValueError(
                f"a block is at most {bm} x {bk} with contiguous columns, not {tuple(b.q.shape)}"
            )
        if b.q.device != device or b.scale.device != device:
            raise ValueError(f"block destinations must be on {device}")
        r, c = b.q.shape
        row = (b.src_offset, b.src_row_stride, b.q.data_ptr() - base_ptr, b.q.stride(0))
        aligned = c == bk and all(v % 8 == 0 for v in row[:2]) and all(v % 16 == 0 for v in row[2:])
        (full if aligned and base_ptr % 16 == 0 else ragged).append(
            (*row, b.scale.data_ptr() - base_ptr, r, c, 0)
        )
        src_bytes += 2 * r * c
        dst_bytes += r * c + 4
    tables = [
        torch.tensor(t, dtype=torch.int64).reshape(-1, 8).to(device) if t else None for t in (full, ragged)
    ]
    base_bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(base.untyped_storage())
    for b in blocks:
        keep.setdefault(id(b.q.untyped_storage()), b.q)
        keep.setdefault(id(b.scale.untyped_storage()), b.scale)
    return BlockTable(*tables, base_bytes, tuple(keep.values()), len(blocks), fmt, src_bytes, dst_bytes)


def param_blocks(
    src_offset: int,
    src_strides: tuple[int, ...],
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> list[Block]:
    """Every block of one FP8 parameter `weight` [..., N, K] (scales [..., ceil(N/bm), ceil(K/bk)]) whose BF16
    source is one strided tensor of the same shape at `src_offset` elements from the source base, with
    `src_strides` in elements (the last one 1)."""
    if src_strides[-1] != 1:
        raise ValueError(f"source columns must be contiguous, strides {src_strides}")
    bm, bk = block
    *lead, n, k = weight.shape
    if tuple(scale.shape) != (*lead, -(-n // bm), -(-k // bk)):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)}")
    out: list[Block] = []
    for idx in _indices(tuple(lead)):
        w, s = weight[idx], scale[idx]
        lead_off = sum(i * st for i, st in zip(idx, src_strides, strict=False))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                off = src_offset + lead_off + i * bm * src_strides[-2] + j * bk
                out.append(
                    Block(off, src_strides[-2], w[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk], s[i, j])
                )
    return out


def quantize_into(
    src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: BlockFp8 = FP32_SCALES
) -> None:
    """Quantize one BF16 tensor (columns contiguous) into an e4m3 parameter and its scales: one launch."""
    if tuple(src.shape) != tuple(weight.shape):
        raise ValueError(f"source {tuple(src.shape)} and weight {tuple(weight.shape)} differ")
    table = build(param_blocks(0, tuple(src.stride()), weight, scale, fmt.block), weight.device, fmt)
    table.launch(src)


def _indices(lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in lead:
        out = [(*o, i) for o in out for i in range(n)]
    return out
