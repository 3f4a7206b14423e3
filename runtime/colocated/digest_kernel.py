"""The Triton kernel behind digest.py, in a module of its own: importing the reader never imports Triton.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


# Step and chunk count change between calls: never compile a variant for a value (Triton's 1 and %16).
@triton.jit(do_not_specialize=["nchunks", "step"])
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
    block_iters,
    ent_period,
    ent_salt,
    ent_nbytes,
    out,
    nchunks,
    step,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: BLOCK chunks of CHUNK logical bytes each. A byte's segment is found by a binary search
    # among the few its chunk's window can touch (block_iters rounds, 0 where every window is one segment);
    # its address is the segment's slot base (relative to `base`) + the segment's offset + the distance in.
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < nchunks
    ent = tl.load(chunk_entry + rows, mask=live, other=0)
    q0 = tl.load(chunk_q0 + rows, mask=live, other=0)
    lo = tl.load(chunk_lo + rows, mask=live, other=0).to(tl.int64)
    hi = tl.load(chunk_hi + rows, mask=live, other=0).to(tl.int64)
    period = tl.load(ent_period + ent, mask=live, other=1)
    salt = tl.load(ent_salt + ent, mask=live, other=0)
    n = tl.load(ent_nbytes + ent, mask=live, other=0)
    q = q0 + ((salt + step) % period) * CHUNK
    x = q[:, None] + tl.arange(0, CHUNK)[None, :]
    valid = live[:, None] & (x < n[:, None])
    s_lo = tl.broadcast_to(lo[:, None], (BLOCK, CHUNK))
    s_hi = tl.broadcast_to(hi[:, None], (BLOCK, CHUNK))
    for _ in range(tl.load(block_iters + pid)):
        mid = (s_lo + s_hi + 1) // 2
        go = tl.load(seg_start + mid, mask=valid, other=0) <= x
        s_lo = tl.where(go, mid, s_lo)
        s_hi = tl.where(go, s_hi, mid - 1)
    start = tl.load(seg_start + s_lo, mask=valid, other=0)
    slot = tl.load(seg_slot + s_lo, mask=valid, other=0)
    addr = tl.load(seg_addr + s_lo, mask=valid, other=0)
    delta = tl.load(slot_delta + slot, mask=valid, other=0)
    b = tl.load(base + (delta + addr + (x - start)), mask=valid, other=0).to(tl.int64)
    w = ((((x & 0x7FFFFFFF) * 1540483477) >> 8) & 0xFFFFFF) | 1
    tl.store(out + 1 + rows, tl.sum(b * w, axis=1), mask=live)
