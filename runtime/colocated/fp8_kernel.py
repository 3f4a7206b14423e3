"""The Triton kernel behind fp8_copy.py: BF16 blocks in, e4m3 weights and their fp32 scale out, one program
per 128x128 block, equal bit for bit to fp8_block.quantize.

Nothing is left to the device's or the interpreter's own conventions: the amax ignores NaN explicitly and a
flag carries it (GPU max instructions drop NaN, numpy's keep it), the scale is amax times fp32 1/448 (what
torch computes on CUDA), the one division is `div_rn`, and the e4m3
rounding is integer arithmetic on the fp32 bits (Triton's interpreter casts to fp8 without ties-to-even,
saturation or subnormals), so a CPU run under TRITON_INTERPRET=1 checks the very arithmetic the GPU runs.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl

from colocate_runtime.colocated.fp8_block import E4M3_MAX_RECIPROCAL as _RECIPROCAL

E4M3_MAX_RECIPROCAL: tl.constexpr = tl.constexpr(_RECIPROCAL)

# Row fields of the block table (int64): see fp8_copy.BlockTable.
SRC, SRC_ROW, DST, DST_ROW, SCALE, ROWS, COLS = 0, 1, 2, 3, 4, 5, 6
FIELDS = 8


@triton.jit
def quantize_blocks(  # type: ignore[no-untyped-def]
    src,
    dst,
    table,
    amax_floor,
    UE8M0: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    FULL: tl.constexpr,
    NATIVE: tl.constexpr,
):
    # src: the BF16 source (a bucket's mapping as bfloat16); dst: uint8 base every destination is addressed
    # from (bytes); table: int64 [n, FIELDS] rows (src element offset, src row stride in elements, e4m3 byte
    # offset from dst, e4m3 row stride in bytes, scale byte offset from dst, rows, cols, unused). FULL: the
    # table's blocks are all BK columns wide with 16-byte aligned rows on both sides.
    pid = tl.program_id(0).to(tl.int64)
    row = table + pid * 8
    s_off = tl.load(row + 0)
    s_row = tl.load(row + 1)
    d_off = tl.load(row + 2)
    d_row = tl.load(row + 3)
    sc_off = tl.load(row + 4)
    rows = tl.load(row + 5)
    cols = tl.load(row + 6)
    r = tl.arange(0, BM).to(tl.int64)
    c = tl.arange(0, BK).to(tl.int64)
    if FULL:  # every row BK wide, 16-byte aligned (fp8_copy.build sorts): no column mask, vector accesses
        s_off = tl.multiple_of(s_off, 8)
        s_row = tl.multiple_of(s_row, 8)
        d_off = tl.multiple_of(d_off, 16)
        d_row = tl.multiple_of(d_row, 16)
        mask = tl.broadcast_to(r[:, None] < rows, (BM, BK))
    else:
        mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(src + s_off + r[:, None] * s_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    nan = x != x
    has_nan = tl.max(tl.max(nan.to(tl.int32), axis=1), axis=0) > 0
    amax = tl.max(tl.max(tl.where(nan, 0.0, tl.abs(x)), axis=1), axis=0)
    s = tl.maximum(amax, amax_floor) * E4M3_MAX_RECIPROCAL  # as torch on CUDA: see fp8_block.scales
    if UE8M0:
        sb = s.to(tl.int32, bitcast=True)
        e = (sb >> 23) & 0xFF
        e = e + ((sb & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(e, 1), 254)
        e = tl.where(has_nan, 254, e)  # ceil_to_ue8m0(NaN) = 2^127
        s = (e << 23).to(tl.float32, bitcast=True)
        s_bits = e << 23
    else:
        s_bits = tl.where(has_nan, 0x7FC00000, s.to(tl.int32, bitcast=True))
        s = s_bits.to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(1.0, s)
    y = x * inv
    y = tl.where(y > 448.0, 448.0, y)
    y = tl.where(y < -448.0, -448.0, y)
    if NATIVE:  # noqa: SIM108 (a constexpr branch)  the GPU's cvt.rn.satfinite, as torch's cast on CUDA
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = _e4m3_bits(y)
    tl.store(dst + d_off + r[:, None] * d_row + c[None, :], q, mask=mask)
    tl.store((dst + sc_off).to(tl.pointer_type(tl.int32)), s_bits)


@triton.jit
def _e4m3_bits(y):  # type: ignore[no-untyped-def]
    # e4m3fn by integer arithmetic on the fp32 bits, round to nearest even (y is within +-448 or NaN)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range (|y| >= 2^-6): keep 3 of 23 mantissa bits, ties to even, rebias the exponent 127 -> 7
    rounded = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (rounded >> 20) - ((127 - 7) << 3)
    # subnormals, step 2^-9: |y| * 512 rounded to an integer (0..8) by the 2^23 trick (exact, ties to even)
    m = tl.abs(y) * 512.0 + 8388608.0
    sub = m.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0x3C800000, sub, normal)  # 0x3C800000 = 2^-6
    code = tl.where(a > 0x7F800000, 0x7F, code | sign)  # NaN: canonical 0x7F
    return code.to(tl.uint8)
