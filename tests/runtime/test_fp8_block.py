"""The reference block-FP8 quantizer (runtime/colocated/fp8_block.py) against the references it follows,
transcribed here as oracles, and its edge cases: ragged edges, all-zero blocks, NaN, Inf, UE8M0 scales, the
round-trip error bound."""

from __future__ import annotations

import math

import pytest
import torch

from colocate_runtime.colocated import fp8_block
from colocate_runtime.colocated.fp8_block import BlockFp8, dequantize, quantize, scale_shape

UE8M0 = BlockFp8(ue8m0=True)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def slime_blockwise(x: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's `_blockwise_cast_to_fp8_triton` (kernels/fp8_kernel.py), block by block in torch, with the
    arithmetic torch does on CUDA: `amax / 448` by a Python scalar is `amax * fp32(1 / 448)` there (on the CPU
    torch divides exactly, 1 ulp apart in about half of all blocks)."""
    m, n = x.shape
    y = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // bn), -(-n // bk), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            t = x[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            amax = torch.maximum(t.abs().max(), torch.tensor(1e-10, dtype=torch.float32))
            x_s = amax * (torch.tensor(1.0) / torch.tensor(FP8_MAX))
            s_inv = 1.0 / x_s
            y[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = torch.clamp(t * s_inv, -FP8_MAX, FP8_MAX).to(
                torch.float8_e4m3fn
            )
            s[i, j] = x_s
    return y, s


def deepgemm_per_block_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang 0.5.23's `per_block_cast_to_fp8` and `ceil_to_ue8m0` (fp8_utils.py, copied from DeepGEMM)."""

    def ceil_to_ue8m0(v: torch.Tensor) -> torch.Tensor:
        bits = v.abs().float().view(torch.int32)
        exp = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        exp = exp + (mantissa != 0).to(torch.int32)
        exp = exp.clamp(1, 254)
        return (exp << 23).view(torch.float32)

    m, n = x.shape
    x_padded = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype)
    x_padded[:m, :n] = x
    x_view = x_padded.view(-1, 128, x_padded.size(1) // 128, 128)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = ceil_to_ue8m0(x_amax / 448.0)
    x_scaled = (x_view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return x_scaled.view_as(x_padded)[:m, :n].contiguous(), sf.view(x_view.size(0), x_view.size(2))


def weights(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """BF16 weights with a different magnitude in every row and column band (scales differ per block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = torch.logspace(-3, 1, shape[-2]).unsqueeze(-1)
    cols = torch.logspace(0, -2, shape[-1])
    return (x * rows * cols).to(torch.bfloat16)


def qbits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 128), (5, 7), (129, 257)])
def test_fp32_scales_equal_slime_blockwise_bit_for_bit(shape: tuple[int, int]) -> None:
    x = weights(shape)
    q, s = quantize(x)
    rq, rs = slime_blockwise(x)
    assert s.shape == scale_shape(shape) == rs.shape
    assert torch.equal(qbits(q), qbits(rq))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (5, 7)])
def test_ue8m0_scales_equal_sglang_per_block_cast_bit_for_bit(shape: tuple[int, int]) -> None:
    x = weights(shape, seed=1)
    q, s = quantize(x, UE8M0)
    rq, rs = deepgemm_per_block_cast_to_fp8(x)
    assert torch.equal(qbits(q), qbits(rq))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    # powers of two (no mantissa bits), at or above amax / 448
    assert ((s.view(torch.int32) & 0x7FFFFF) == 0).all()
    amax = fp8_block.block_amax(x).clamp(min=1e-4)
    assert (s >= amax / 448.0).all() and (s < 2 * amax / 448.0).all()


def test_ragged_edges_ignore_padding() -> None:
    """An edge block's scale comes from its real elements only; ceil(N/128) x ceil(K/128) scales."""
    x = torch.full((130, 129), 0.5, dtype=torch.bfloat16)
    x[128:, :] = 3.0  # the bottom edge blocks: two rows
    x[:128, 128] = 7.0  # the right edge block: one column
    q, s = quantize(x)
    assert s.shape == (2, 2)
    assert s[0, 0].item() == pytest.approx(0.5 / 448, rel=1e-7)
    assert s[0, 1].item() == pytest.approx(7.0 / 448, rel=1e-7)
    assert s[1, 0].item() == pytest.approx(3.0 / 448, rel=1e-7)
    assert (q.float() == 448).all()  # 0.5, 3 and 7 each land on 448 (their block's amax)
    # within an ulp: the scale is amax times fp32 1/448, not an exact division
    assert torch.allclose(dequantize(q, s), x.float(), rtol=2**-22, atol=0)


def test_expert_stacks_quantize_per_expert() -> None:
    x = weights((3, 256, 128), seed=2)
    q, s = quantize(x)
    assert s.shape == (3, 2, 1)
    for e in range(3):
        qe, se = quantize(x[e])
        assert torch.equal(qbits(q[e]), qbits(qe)) and torch.equal(s[e], se)


@pytest.mark.parametrize("fmt", [BlockFp8(), UE8M0], ids=["fp32", "ue8m0"])
def test_all_zero_blocks_dequantize_to_zero(fmt: BlockFp8) -> None:
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    x[200, 200] = -0.0
    q, s = quantize(x, fmt)
    assert torch.isfinite(s).all() and (s > 0).all()
    expected = (
        fp8_block.ceil_to_ue8m0(torch.tensor(1e-4 / 448.0))
        if fmt.ue8m0
        else torch.tensor(1e-10) * fp8_block.E4M3_MAX_RECIPROCAL
    )
    assert s[1, 1].item() == expected.item()
    if fmt.ue8m0:
        assert s[1, 1].item() == 2.0**-22
    assert not torch.isnan(q.float()).any()
    assert qbits(q)[200, 200] == 0x80  # -0.0 keeps its sign
    assert torch.equal(dequantize(q, s)[128:, 128:], torch.zeros(128, 128))


def test_nan_fp32_scales_poison_the_block() -> None:
    x = weights((256, 256), seed=3)
    x[3, 130] = float("nan")
    q, s = quantize(x)
    assert s.view(torch.int32)[0, 1] == fp8_block.FP32_NAN
    assert (qbits(q)[:128, 128:] == fp8_block.E4M3_NAN).all()
    other = quantize(torch.cat([x[:, :128], torch.zeros(256, 128, dtype=torch.bfloat16)], 1))[0]
    assert torch.equal(qbits(q)[:, :128], qbits(other)[:, :128])  # the other blocks are untouched
    assert torch.isfinite(s[:, 0]).all() and torch.isfinite(s[1]).all()
    # negative NaN too: written canonically
    x[3, 130] = -float("nan")
    assert (qbits(quantize(x)[0])[:128, 128:] == fp8_block.E4M3_NAN).all()


def test_nan_ue8m0_follows_ceil_to_ue8m0() -> None:
    x = weights((128, 256), seed=4)
    x[5, 5] = float("nan")
    q, s = quantize(x, UE8M0)
    assert s[0, 0].item() == 2.0**127
    rq, rs = deepgemm_per_block_cast_to_fp8(x)
    assert torch.equal(s, rs) and torch.equal(qbits(q), qbits(rq))
    block = qbits(q)[:, :128]
    assert block[5, 5] == fp8_block.E4M3_NAN
    finite = torch.ones_like(block, dtype=torch.bool)
    finite[5, 5] = False
    assert ((block[finite] & 0x7F) == 0).all()  # +-0: finite values vanish under 2^127


def test_inf() -> None:
    x = weights((128, 256), seed=5)
    x[1, 1] = float("inf")
    x[2, 2] = -float("inf")
    q, s = quantize(x)
    assert math.isinf(s[0, 0].item())
    b = qbits(q)[:, :128]
    assert b[1, 1] == b[2, 2] == fp8_block.E4M3_NAN  # inf * (1 / inf) = inf * 0
    mask = torch.ones_like(b, dtype=torch.bool)
    mask[1, 1] = mask[2, 2] = False
    assert ((b[mask] & 0x7F) == 0).all()
    q8, s8 = quantize(x, UE8M0)
    assert s8[0, 0].item() == 2.0**127
    assert qbits(q8)[1, 1] == 0x7E and qbits(q8)[2, 2] == 0xFE  # +-448, saturated
    assert torch.equal(qbits(q)[:, 128:], qbits(quantize(x[:, 128:])[0]))


def test_saturation_and_rounding() -> None:
    """Largest element of a block lands on +-448 exactly; ties round to even (e4m3 RNE)."""
    x = torch.tensor([[448.0, -448.0, 224.0, 13.0, 13.5, 12.5]], dtype=torch.bfloat16)
    q, s = quantize(x)
    assert s.item() == 1.0
    # 13 is between 12 and 14 (spacing 1 at 8..16, ties: 12.5 -> 12, 13.5 -> 14)
    assert q.float().tolist() == [[448.0, -448.0, 224.0, 13.0, 14.0, 12.0]]


@pytest.mark.parametrize("fmt", [BlockFp8(), UE8M0], ids=["fp32", "ue8m0"])
def test_round_trip_error_bound(fmt: BlockFp8) -> None:
    x = weights((384, 512), seed=6)
    x[0:128, 0:128] *= 1e-6  # a block deep in e4m3's subnormals relative to nothing: tiny amax
    q, s = quantize(x, fmt)
    err = (dequantize(q, s) - x.float()).abs()
    assert (err <= fp8_block.error_bound(x, s)).all()
    # and the bound is not vacuous: relative error of the bulk is about 2^-5 on average
    rel = err / x.float().abs().clamp(min=1e-30)
    assert rel[x.float().abs() > 1e-3].mean() < 2.0**-4
