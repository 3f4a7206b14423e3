"""The Triton kernel behind digest.py, in a module of its own: importing the reader never imports Triton.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


# Tile0 changes between launches: never compile a variant for its value (Triton's 1 and multiples of 16).
@triton.jit(do_not_specialize=["tile0"])
def digest_tiles(  # type: ignore[no-untyped-def]
    base,
    inputs,
    seg_start,
    seg_slot,
    seg_addr,
    chunk_lo,
    chunk_hi,
    tiles,
    out,
    tile0,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    COLUMNS: tl.constexpr,
    PER_BYTE: tl.constexpr,
):
    # One program: one tile, up to TILE chunks of CHUNK logical bytes of one entry (rows of the chunk table),
    # added into the entry's sum with one atomic add. The sum is kept modulo 2**32 (uint32 arithmetic, which
    # the GPU does natively, where int64 is emulated): the digest is its low 16 bits. A tile whose chunks all
    # lie in one segment (depth < 0) finds its addresses from its own row of the tile table. Elsewhere a
    # chunk's segment is found by a binary search among the few its window touches (the tile's deepest
    # search); where an entry's segments all start on a chunk boundary a chunk lies in one segment (one
    # search per chunk), else (PER_BYTE) each byte searches. A byte's address: its segment's slot base
    # (inputs[1 + slot], relative to `base`) + the segment's offset + the distance in. The step is
    # inputs[0], so a captured CUDA graph replays any step. A tile's row (COLUMNS int64s): entry, first
    # chunk row, rows, depth, first window's logical byte, period, salt, entry bytes, slot, storage offset
    # minus logical offset (the last two where depth < 0).
    row = tiles + (tile0 + tl.program_id(0)).to(tl.int64) * COLUMNS
    nrows = tl.load(row + 2)
    depth = tl.load(row + 3)
    period = tl.load(row + 5)
    i = tl.arange(0, TILE)
    live = i < nrows
    shift = ((tl.load(row + 6) + tl.load(inputs)) % period) * CHUNK
    q = tl.load(row + 4) + i * (period * CHUNK) + shift
    x = q[:, None] + tl.arange(0, CHUNK)[None, :]
    valid = live[:, None] & (x < tl.load(row + 7))
    if depth < 0:  # the whole tile in one segment (names of their own: Triton types a name once per `if`)
        at = tl.load(inputs + 1 + tl.load(row + 8)) + tl.load(row + 9) + x
    elif PER_BYTE:
        rows = tl.load(row + 1) + i
        lo = tl.load(chunk_lo + rows, mask=live, other=0).to(tl.int64)
        hi = tl.load(chunk_hi + rows, mask=live, other=0).to(tl.int64)
        s_lo = tl.broadcast_to(lo[:, None], (TILE, CHUNK))
        s_hi = tl.broadcast_to(hi[:, None], (TILE, CHUNK))
        for _ in range(depth):
            mid = (s_lo + s_hi + 1) // 2
            go = tl.load(seg_start + mid, mask=valid, other=0) <= x
            s_lo = tl.where(go, mid, s_lo)
            s_hi = tl.where(go, s_hi, mid - 1)
        start = tl.load(seg_start + s_lo, mask=valid, other=0)
        slot = tl.load(seg_slot + s_lo, mask=valid, other=0)
        addr = tl.load(seg_addr + s_lo, mask=valid, other=0)
        at = tl.load(inputs + 1 + slot, mask=valid, other=0) + addr + (x - start)
    else:
        rows = tl.load(row + 1) + i
        c_lo = tl.load(chunk_lo + rows, mask=live, other=0).to(tl.int64)
        c_hi = tl.load(chunk_hi + rows, mask=live, other=0).to(tl.int64)
        for _ in range(depth):
            mid = (c_lo + c_hi + 1) // 2
            go = tl.load(seg_start + mid, mask=live, other=0) <= q
            c_lo = tl.where(go, mid, c_lo)
            c_hi = tl.where(go, c_hi, mid - 1)
        start = tl.load(seg_start + c_lo, mask=live, other=0)
        slot = tl.load(seg_slot + c_lo, mask=live, other=0)
        addr = tl.load(seg_addr + c_lo, mask=live, other=0)
        delta = tl.load(inputs + 1 + slot, mask=live, other=0)
        at = (delta + addr - start)[:, None] + x
    b = tl.load(base + at, mask=valid, other=0).to(tl.uint32)
    # w(x) = bits 8..31 of (x mod 2**31) * 1540483477, odd: only the product's low 32 bits matter.
    w = ((((x & 0x7FFFFFFF).to(tl.uint32) * 1540483477) >> 8) & 0xFFFFFF) | 1
    tl.atomic_add(out + tl.load(row), tl.sum(tl.sum(b * w, axis=1), axis=0).to(tl.int32))
