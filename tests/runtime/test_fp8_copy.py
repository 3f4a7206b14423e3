"""The quantize-on-copy kernel (colocated/fp8_copy.py, fp8_kernel.py) under TRITON_INTERPRET=1: bit for bit
the reference quantizer (fp8_block.quantize), edge cases included, for whole parameters, expert stacks,
strided sources and one launch over several parameters; and its own e4m3 rounding against torch's cast."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton decides at its first import whether its jit functions (its standard library's too) are interpreted:
# this module must be the first to import it in the process (nothing else in the CPU tiers imports Triton).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from colocate_runtime.colocated import fp8_block, fp8_copy
from colocate_runtime.colocated.fp8_block import BlockFp8

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 = NaN
if not triton.knobs.runtime.interpret:
    pytest.skip(
        "Triton was imported before this module, not interpreted (CUDA runs test_fp8_copy_gpu.py)",
        allow_module_level=True,
    )
UE8M0 = BlockFp8(ue8m0=True)
FP32 = BlockFp8()
FMTS = [pytest.param(BlockFp8(), id="fp32"), pytest.param(UE8M0, id="ue8m0")]


def empty_like_fp8(shape: tuple[int, ...], fmt: BlockFp8 = FP32) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.full(shape, 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full(fmt.scale_shape(shape), -1.0)
    return w, s


def check_equal(src: torch.Tensor, w: torch.Tensor, s: torch.Tensor, fmt: BlockFp8) -> None:
    rq, rs = fp8_block.quantize(src, fmt)
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), (s, rs)
    assert torch.equal(w.view(torch.uint8), rq.view(torch.uint8))


def weights(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return (x * torch.logspace(-4, 1, shape[-2]).unsqueeze(-1)).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(256, 256), (200, 300), (7, 5)])
def test_whole_parameter_bit_equal(shape: tuple[int, int], fmt: BlockFp8) -> None:
    src = weights(shape)
    w, s = empty_like_fp8(shape, fmt)
    fp8_copy.quantize_into(src, w, s, fmt)
    check_equal(src, w, s, fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_edge_cases_bit_equal(fmt: BlockFp8) -> None:
    """All-zero and -0 blocks, NaN (both signs), +-Inf, subnormal-range values, ties, saturation."""
    src = weights((384, 256), seed=1)
    src[0:128, 128:256] = 0.0
    src[5, 130] = -0.0
    src[128 + 3, 7] = float("nan")
    src[128 + 4, 200] = -float("nan")
    src[256 + 1, 1] = float("inf")
    src[256 + 2, 2] = -float("inf")
    src[0:128, 0:128] *= 1e-5  # most values land in e4m3's subnormals
    src[0, 0] = 448.0  # one large value: everything else rounds near 0, ties included
    w, s = empty_like_fp8(tuple(src.shape), fmt)
    fp8_copy.quantize_into(src, w, s, fmt)
    check_equal(src, w, s, fmt)


def test_e4m3_rounding_matches_torch_cast() -> None:
    """The kernel's integer e4m3 rounding equals torch's cast for every bf16 value in [-448, 448] (a 1.0
    scale: a block whose amax is exactly 448), ties and subnormals included."""
    every = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = every[torch.isfinite(every) & (every.abs() <= 448)]
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 128, dtype=torch.bfloat16)])
    x = vals.reshape(-1, 128)
    x[:, 0] = 448.0  # every row block has amax 448: scale exactly 1.0, y == x
    w, s = empty_like_fp8(tuple(x.shape))
    fp8_copy.quantize_into(x, w, s)
    assert (s == 1.0).all()
    assert torch.equal(w.view(torch.uint8), x.float().to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_expert_stack_from_strided_source(fmt: BlockFp8) -> None:
    """w13-like [E, 2I, H] from a source whose rows are strided (a column slice of a wider trainer tensor)."""
    wide = weights((3, 256, 384), seed=2)
    src = wide[:, :, 128:]  # rows 384 apart, columns contiguous
    w, s = empty_like_fp8((3, 256, 256), fmt)
    fp8_copy.quantize_into(src, w, s, fmt)
    check_equal(src.contiguous(), w, s, fmt)


def test_one_launch_many_parameters_from_one_bucket() -> None:
    """Several parameters (the parts of a fused q/k/v weight, a down projection) quantized out of one flat
    BF16 bucket in one launch, each block from its own offset."""
    qkv = weights((512, 256), seed=3)  # q 256 rows, k 128, v 128: each a whole number of row blocks
    down = weights((256, 384), seed=4)
    bucket = torch.zeros(4096 + qkv.numel() + down.numel(), dtype=torch.bfloat16)
    q_off = 64  # the pieces sit at arbitrary element offsets in the bucket
    k_off = q_off + 256 * 256 + 128
    v_off = k_off + 128 * 256 + 8
    d_off = v_off + 128 * 256 + 1001  # odd: down's blocks take the kernel's unaligned variant
    bucket[q_off : q_off + 256 * 256] = qkv[:256].flatten()
    bucket[k_off : k_off + 128 * 256] = qkv[256:384].flatten()
    bucket[v_off : v_off + 128 * 256] = qkv[384:].flatten()
    bucket[d_off : d_off + down.numel()] = down.flatten()
    w_qkv, s_qkv = empty_like_fp8((512, 256))
    w_down, s_down = empty_like_fp8((256, 384))
    blocks = []
    for off, row0, rows in ((q_off, 0, 256), (k_off, 256, 128), (v_off, 384, 128)):
        blocks += fp8_copy.param_blocks(
            off, (256, 1), w_qkv[row0 : row0 + rows], s_qkv[row0 // 128 : (row0 + rows) // 128]
        )
    blocks += fp8_copy.param_blocks(d_off, (384, 1), w_down, s_down)
    table = fp8_copy.build(blocks, torch.device("cpu"))
    assert table.nblocks == 4 * 2 + 2 * 3
    assert table.full is not None and table.full.shape[0] == 8  # q, k, v: aligned, full width
    assert table.ragged is not None and table.ragged.shape[0] == 6
    table.launch(bucket)
    check_equal(qkv, w_qkv, s_qkv, BlockFp8())
    check_equal(down, w_down, s_down, BlockFp8())


def test_refuses_what_it_cannot_take() -> None:
    w, s = empty_like_fp8((256, 256))
    with pytest.raises(ValueError, match="scale shape"):
        fp8_copy.param_blocks(0, (256, 1), w, s[:1])
    with pytest.raises(ValueError, match="contiguous"):
        fp8_copy.param_blocks(0, (1, 256), w, s)
    with pytest.raises(TypeError):
        fp8_copy.build(
            [fp8_copy.Block(0, 256, w[:128, :128].view(torch.uint8), s[0, 0])], torch.device("cpu")
        )
    table = fp8_copy.build(fp8_copy.param_blocks(0, (256, 1), w, s), torch.device("cpu"))
    with pytest.raises(TypeError, match="bfloat16"):
        table.launch(torch.zeros(256 * 256))
