"""The reference 128x128 block-FP8 quantizer (e4m3 weights, one fp32 `weight_scale_inv` per block), in torch.

This is the arithmetic the quantize-on-copy kernel (fp8_kernel.py) must equal bit for bit, and the one the RL
frameworks and SGLang use to put BF16 weights into SGLang's block-FP8 parameters:

- fp32 scales (Hopper, and every GPU where SGLang's DeepGEMM path does not ask for UE8M0): slime's online
  quantizer, `blockwise_cast_to_fp8_triton` (slime/backends/megatron_utils/kernels/fp8_kernel.py, called by
  `_quantize_param` in megatron_to_hf/processors/quantizer_fp8.py, THUDM/slime 624b824): per block
  `amax = max(max|x|, 1e-10)` in fp32, `s = amax / 448`, `q = e4m3(clamp(x * (1 / s), -448, 448))`, and `s`
  is stored as `weight_scale_inv` (the dequantized weight is `q * s`). Its offline converter
  (tools/convert_hf_to_fp8.py `block_fp8`) is the same up to `x / s` and a 1e-12 floor.
- UE8M0 scales (power-of-two scales, rounded up): SGLang's `per_block_cast_to_fp8` and `ceil_to_ue8m0`
  ("copied from DeepGEMM", sglang/srt/layers/quantization/fp8_utils.py; SGLang 0.5.23), used by SGLang's
  `quant_weight_ue8m0` / `requant_weight_ue8m0` and slime's quantizer when
  `should_deepgemm_weight_requant_ue8m0` holds: `amax = max(max|x|, 1e-4)`, `s = 2^ceil(log2(amax / 448))` by
  exponent bits (exponent clamped to [1, 254]), `q = e4m3(x * (1 / s))`. SGLang's switch is
  `deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0`: JIT DeepGEMM on sm100 (0.5.10: Blackwell), or sm120/121 (0.5.23),
  and for a dense layer only with a bf16 output and N % 64 == 0, K % 128 == 0 (0.5.23). On an H200 it is off.
  (SGLang 0.5.10's `ceil_to_ue8m0` is `2 ** ceil(log2(x))` in fp32, which can round a value just above a
  power of two down to it; we follow the exact exponent-bit version of 0.5.23 and DeepGEMM.) SGLang then
  packs UE8M0 scales into DeepGEMM's TMA-aligned int32 layout (`transform_scale_ue8m0`); that packing is a
  layout step after this one and not part of the block math.

The rules for the cases the references leave implicit, all followed bit for bit by the kernel:
- Ragged edge blocks (a dimension not a multiple of 128): the block covers only the real elements; the
  references pad with zeros, which cannot change `max|x|` (|x| >= 0), so padding and ignoring are the same.
  The scale tensor has ceil(N / 128) x ceil(K / 128) entries, as SGLang's `BlockQuantScaleParameter`.
- All-zero blocks: the amax floor keeps the scale finite and nonzero (fp32: 1e-10 / 448; UE8M0: 2^-22), so
  `q` is 0 (the sign of -0.0 kept) and the dequantized block is exactly 0, never NaN.
- NaN: `max|x|` propagates NaN (torch's amax, as slime's and SGLang's torch paths). fp32 scales: the block's
  scale is NaN and every `q` in it NaN. UE8M0: `ceil_to_ue8m0(NaN)` is 2^127 (exponent bits 255 + 1 clamped
  to 254), so finite values become +-0 and NaNs stay NaN. IEEE arithmetic does not carry a NaN's sign or
  payload the same way on every device, so every NaN is written canonically: e4m3 0x7F, fp32 0x7FC00000.
- Inf: fp32 scales: amax = s = inf, `1 / s` = 0, so finite values become +-0 and +-inf becomes NaN (inf * 0).
  UE8M0: s = 2^127, finite values become +-0 and +-inf saturates to +-448.
- Rounding: fp32 `x * (1 / s)` (bf16 widened exactly), then e4m3 round-to-nearest-even, saturating: values
  beyond +-448 become +-448 (slime's clamp; torch's cast and the GPU's `cvt.rn.satfinite` saturate too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E4M3_MAX_RECIPROCAL = float(torch.tensor(1.0) / torch.tensor(E4M3_MAX))  # 1/448 rounded to fp32
BLOCK = 128
FORMAT = "fp8_e4m3_block128"  # the target dtype's name in plans and bench lines
FP32_AMAX_FLOOR = 1e-10  # slime's blockwise_cast_to_fp8_triton eps
UE8M0_AMAX_FLOOR = 1e-4  # DeepGEMM's / SGLang's per_block_cast_to_fp8 clamp
E4M3_NAN = 0x7F
FP32_NAN = 0x7FC00000


@dataclass(frozen=True, slots=True)
class BlockFp8:
    """How SGLang holds one block-FP8 weight: e4m3 values, one scale per `block` (rows, columns)."""

    block: tuple[int, int] = (BLOCK, BLOCK)
    ue8m0: bool = False  # power-of-two scales (SGLang's DeepGEMM path on Blackwell), else any fp32 scale

    @property
    def amax_floor(self) -> float:
        return UE8M0_AMAX_FLOOR if self.ue8m0 else FP32_AMAX_FLOOR

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return scale_shape(shape, self.block)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, ...]:
    """`weight_scale_inv`'s shape for a weight of `shape` (leading dimensions, e.g. experts, kept)."""
    if len(shape) < 2:
        raise ValueError(f"a block-FP8 weight has at least two dimensions, not {shape}")
    *lead, n, k = shape
    return (*lead, ceil_div(n, block[0]), ceil_div(k, block[1]))


def block_amax(x: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """max |x| of each block in fp32 (NaN if the block holds one), over the real elements only."""
    *lead, n, k = x.shape
    bn, bk = block
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    padded = x.new_zeros((*lead, nb * bn, kb * bk))
    padded[..., :n, :k] = x
    tiles = padded.float().abs().reshape(*lead, nb, bn, kb, bk)
    return tiles.amax(dim=(-3, -1))  # amax propagates NaN


def ceil_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """The power of two at or above |s| by its exponent bits (DeepGEMM's, SGLang 0.5.23's)."""
    bits = s.abs().float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def scales(amax: torch.Tensor, fmt: BlockFp8 = BlockFp8()) -> torch.Tensor:
    """Each block's `weight_scale_inv` from its amax (fp32; NaN canonical)."""
    # `* (1 / 448)`, not `/ 448`: torch on CUDA divides by a Python scalar as a multiply by its fp32
    # reciprocal, so that is what slime's and SGLang's quantizers compute on the GPU (1 ulp apart from an
    # exact division in about half of all blocks).
    s = amax.float().clamp(min=fmt.amax_floor) * E4M3_MAX_RECIPROCAL  # clamp keeps NaN
    if fmt.ue8m0:
        s = ceil_to_ue8m0(s)
    return _canonical_nan_fp32(s)


def quantize(x: torch.Tensor, fmt: BlockFp8 = BlockFp8()) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight of x's shape, fp32 `weight_scale_inv` of `scale_shape`) for a [..., N, K] weight."""
    if x.dim() < 2:
        raise ValueError(f"a block-FP8 weight has at least two dimensions, not {tuple(x.shape)}")
    n, k = x.shape[-2:]
    bn, bk = fmt.block
    s = scales(block_amax(x, fmt.block), fmt)
    inv = 1.0 / s
    expanded = inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    y = x.float() * expanded
    y = y.clamp(-E4M3_MAX, E4M3_MAX)  # keeps NaN; what the saturating cast would do anyway
    q = y.to(torch.float8_e4m3fn)
    q.view(torch.uint8)[torch.isnan(y)] = E4M3_NAN
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """fp32 `q * s`, each block times its scale (SGLang's `block_quant_dequant`, in fp32)."""
    *_, n, k = q.shape
    expanded = s.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * expanded[..., :n, :k]


def error_bound(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """A bound on |x - dequantize(quantize(x))| for finite x: e4m3 keeps 3 mantissa bits (a relative
    half-ulp of 2^-4 in its normal range, |q| >= 2^-6) and spaces its subnormals 2^-9 apart (half of that,
    times the scale)."""
    *_, n, k = x.shape
    expanded = s.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]
    return x.float().abs() * 2.0**-4 + expanded * 2.0**-10


def _canonical_nan_fp32(s: torch.Tensor) -> torch.Tensor:
    s = s.clone()
    s.view(torch.int32)[torch.isnan(s)] = FP32_NAN
    return s
