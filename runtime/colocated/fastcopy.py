"""One kernel launch per bucket that copies all of its whole-parameter entries into their parameters (Triton).

Why: one `copy_` per entry costs the reader's host several microseconds (dispatch, checks, the memcpy call)
and the device a launch with its ramp-up and tail each; at a few hundred entries of tens of megabytes the
copy phase ran about a third over one flat copy of the same bytes. A tile table built once per layout (source
offset in the bucket, destination, length) lets one launch per bucket copy every eligible entry; the bucket's
own address, the only thing that changes from step to step (a new IPC mapping), is the kernel's argument.

Destinations are addressed as byte offsets from one base parameter: in CUDA's unified address space
`base + (ptr - base)` is the parameter's address. The table keeps every parameter it addresses alive.

Eligible: a contiguous destination on the bucket's device, 16-byte aligned, whose byte count is a multiple of
16 (so every access is a 16-byte vector). Everything else stays with `copy_`. Without Triton (or on CPU)
nothing is eligible and the reader copies as before. Triton is imported on first use only.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# 64 KiB per program, all of it loaded before it is stored (16 vectors a thread at 8 warps): 3.89 ms for
# 8 GB in 400 entries on an H200 against 3.75 ms for one flat copy_ of the same bytes; 16 KiB in flight
# took 4.06 ms, 8 KiB at 4 warps 4.06 ms, one copy_ per entry 5.04 ms (bench/colocated_bench.py --role copy).
TILE_BYTES = 64 << 10
BLOCK_BYTES = 64 << 10
WARPS = 8
VECTOR = 16


@functools.cache
def _kernel_module() -> ModuleType | None:
    try:
        from colocate_runtime.colocated import copy_kernel
    except ImportError as err:  # images without Triton copy with copy_
        log.info("batched copy kernel unavailable (%s); copying entry by entry", err)
        return None
    return copy_kernel


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel_module() is not None


def eligible(dst: torch.Tensor, nbytes: int, src_offset: int, device: torch.device) -> bool:
    return (
        dst.device == device
        and dst.is_contiguous()
        and dst.data_ptr() % VECTOR == 0
        and nbytes % VECTOR == 0
        and src_offset % VECTOR == 0
        and nbytes == dst.numel() * dst.element_size()
    )


@dataclass(slots=True)
class TileTable:
    """The copies of one bucket: device-resident tiles and the parameters they address."""

    tiles: torch.Tensor  # int64 [n, 3] on the device
    dst_base: torch.Tensor  # uint8 view of the first destination: offsets in `tiles` are bytes from it
    keep: tuple[torch.Tensor, ...]  # every destination, so no address in `tiles` can be freed under it
    ntiles: int
    nbytes: int
    block: int = BLOCK_BYTES
    warps: int = WARPS
    tile: int = TILE_BYTES

    def launch(self, bucket: torch.Tensor) -> None:
        """Enqueue the copies on the current stream. `bucket`: this step's flat uint8 mapping."""
        if bucket.dtype != torch.uint8 or bucket.device != self.tiles.device:
            raise TypeError(
                f"bucket must be uint8 on {self.tiles.device}, got {bucket.dtype} on {bucket.device}"
            )
        if self.ntiles == 0:
            return
        kernel = _kernel_module()
        assert kernel is not None
        kernel.copy_tiles[(self.ntiles,)](
            bucket, self.dst_base, self.tiles, TILE=self.tile, BLOCK=self.block, num_warps=self.warps
        )


def build(
    copies: list[tuple[int, torch.Tensor, int]],
    device: torch.device,
    *,
    block: int = BLOCK_BYTES,
    warps: int = WARPS,
    tile: int = TILE_BYTES,
) -> TileTable:
    """`copies`: (byte offset in the bucket, destination, byte count), each `eligible`. `tile`: bytes per
    program, a multiple of `block`."""
    if tile % block:
        raise ValueError(f"tile {tile} is not a multiple of block {block}")
    if not copies:
        raise ValueError("no copies")
    base = copies[0][1]
    base_ptr = base.data_ptr()
    rows: list[tuple[int, int, int]] = []
    total = 0
    for src_offset, dst, nbytes in copies:
        if not eligible(dst, nbytes, src_offset, device):
            raise ValueError(f"a copy of {nbytes} bytes at {src_offset} cannot go through the kernel")
        d = dst.data_ptr() - base_ptr
        for start in range(0, nbytes, tile):
            rows.append((src_offset + start, d + start, min(tile, nbytes - start)))
        total += nbytes
    tiles = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device)
    base_bytes = base.view(-1).view(torch.uint8)
    return TileTable(
        tiles, base_bytes, tuple(dst for _, dst, _ in copies), len(rows), total, block, warps, tile
    )


def warm_up(device: torch.device) -> None:
    """Compile the kernel now (a second or so, once per process), not in the first step."""
    if not available(device):
        return
    src = torch.arange(4 * TILE_BYTES // 8, dtype=torch.int64, device=device).view(torch.uint8)
    dst = torch.zeros(TILE_BYTES + 64, dtype=torch.uint8, device=device)
    # A full tile and a partial one: both branches of the kernel.
    table = build([(0, dst[:TILE_BYTES], TILE_BYTES), (TILE_BYTES, dst[TILE_BYTES:], 64)], device)
    table.launch(src)
    torch.cuda.synchronize(device)
    if not torch.equal(dst, src[: TILE_BYTES + 64]):
        raise RuntimeError("the batched copy kernel copied wrong bytes in its warm-up")
