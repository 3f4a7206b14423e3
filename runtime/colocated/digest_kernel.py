"""The Triton kernel behind digest.py, in a module of its own: importing the reader never imports Triton.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


# Rows and step change between calls: never compile a variant for a value (Triton's 1 and multiples of 16).
@triton.jit(do_not_specialize=["row0", "rows_end", "step"])
def digest_chunks(  # type: ignore[no-untyped-def]
    base,
    slot_delta,
    seg_start,
    seg_slot,
    seg_addr,
    chunk_entry,
    chunk_q0,
    chunk_lo,
    chunk_hi,
    chunk_depth,
    ent_period,
    ent_salt,
    ent_nbytes,
    out,
    row0,
    rows_end,
    step,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_BYTE: tl.constexpr,
):
    # One program: BLOCK chunks of CHUNK logical bytes each, rows [row0, rows_end) of the chunk table. A
    # chunk's segment is found by a binary search among the few its window can touch (the block's deepest
    # search; no round where every window is one segment). Where an entry's segments all start on a chunk
    # boundary a chunk lies in one segment: one search per chunk, its bytes contiguous; elsewhere (PER_BYTE)
    # each byte searches. A byte's address: its segment's slot base (relative to `base`) + the segment's
    # offset + the distance in.
    pid = tl.program_id(0)
    rows = row0 + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < rows_end
    ent = tl.load(chunk_entry + rows, mask=live, other=0)
    q0 = tl.load(chunk_q0 + rows, mask=live, other=0)
    lo = tl.load(chunk_lo + rows, mask=live, other=0).to(tl.int64)
    hi = tl.load(chunk_hi + rows, mask=live, other=0).to(tl.int64)
    depth = tl.max(tl.load(chunk_depth + rows, mask=live, other=0), axis=0)
    period = tl.load(ent_period + ent, mask=live, other=1)
    salt = tl.load(ent_salt + ent, mask=live, other=0)
    n = tl.load(ent_nbytes + ent, mask=live, other=0)
    q = q0 + ((salt + step) % period) * CHUNK
    x = q[:, None] + tl.arange(0, CHUNK)[None, :]
    valid = live[:, None] & (x < n[:, None])
    if PER_BYTE:
        s_lo = tl.broadcast_to(lo[:, None], (BLOCK, CHUNK))
        s_hi = tl.broadcast_to(hi[:, None], (BLOCK, CHUNK))
        for _ in range(depth):
            mid = (s_lo + s_hi + 1) // 2
            go = tl.load(seg_start + mid, mask=valid, other=0) <= x
            s_lo = tl.where(go, mid, s_lo)
            s_hi = tl.where(go, s_hi, mid - 1)
        start = tl.load(seg_start + s_lo, mask=valid, other=0)
        slot = tl.load(seg_slot + s_lo, mask=valid, other=0)
        addr = tl.load(seg_addr + s_lo, mask=valid, other=0)
        delta = tl.load(slot_delta + slot, mask=valid, other=0)
        at = delta + addr + (x - start)
    else:
        c_lo = lo
        c_hi = hi
        for _ in range(depth):
            mid = (c_lo + c_hi + 1) // 2
            go = tl.load(seg_start + mid, mask=live, other=0) <= q
            c_lo = tl.where(go, mid, c_lo)
            c_hi = tl.where(go, c_hi, mid - 1)
        start = tl.load(seg_start + c_lo, mask=live, other=0)
        slot = tl.load(seg_slot + c_lo, mask=live, other=0)
        addr = tl.load(seg_addr + c_lo, mask=live, other=0)
        delta = tl.load(slot_delta + slot, mask=live, other=0)
        at = (delta + addr + (q - start))[:, None] + tl.arange(0, CHUNK)[None, :]
    b = tl.load(base + at, mask=valid, other=0).to(tl.int64)
    w = ((((x & 0x7FFFFFFF) * 1540483477) >> 8) & 0xFFFFFF) | 1
    tl.store(out + 1 + rows, tl.sum(b * w, axis=1), mask=live)
