"""The Triton kernel behind fastcopy.py, in a module of its own: importing the reader never imports Triton.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


@triton.jit
def copy_tiles(src, dst, tiles, TILE: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # tiles: int64 triples (source byte offset in `src`, destination byte offset from `dst`, length).
    pid = tl.program_id(0).to(tl.int64)
    s = tl.multiple_of(tl.load(tiles + 3 * pid), 16)
    d = tl.multiple_of(tl.load(tiles + 3 * pid + 1), 16)
    n = tl.multiple_of(tl.load(tiles + 3 * pid + 2), 16)
    offs = tl.arange(0, BLOCK)
    if n == TILE:  # a full tile: unmasked 16-byte vectors, BLOCK bytes of loads issued before their stores
        for i in tl.static_range(0, TILE, BLOCK):
            v = tl.load(src + s + i + offs)
            tl.store(dst + d + i + offs, v)
    else:  # an entry's last tile; its length is a multiple of 16, so the mask keeps 16-byte vectors
        for i in range(0, n, BLOCK):
            m = i + offs < n
            v = tl.load(src + s + i + offs, mask=m)
            tl.store(dst + d + i + offs, v, mask=m)
