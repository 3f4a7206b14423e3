"""Block-FP8 targets in the reader's copy program (reader_program.compile_program with `scales`, gather.py):
BF16 entries quantized while copied into a fused e4m3 parameter and its `weight_scale_inv`, bit-equal to the
reference quantizer of the whole fused weight: packed buckets and in-place strided views (interleaved
rows), the torch path and the Triton kernel (TRITON_INTERPRET=1 here), and a trainer shard boundary that cuts
a block refused by name."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # see test_fp8_copy.py

from colocate_runtime.colocated import fp8_block
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.manifest import BucketRecord, Manifest, Producer
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.reader_program import compile_program
from colocate_runtime.shards import Box, TensorShard

# The kernel case runs where Triton is interpreted (it was first imported under TRITON_INTERPRET=1, above or
# by test_fp8_copy.py); otherwise test_fp8_interpreted.py runs this module again in a fresh process.
_triton = pytest.importorskip("triton")
KERNEL_ON_CPU = pytest.param(
    torch.device("cpu"),
    marks=pytest.mark.skipif(
        torch.cuda.is_available() or not _triton.knobs.runtime.interpret,
        reason="Triton is not interpreted in this process: test_fp8_interpreted.py runs this in a fresh one",
    ),
)
H = 256
PARTS = {"q": (0, 256), "k": (256, 128), "v": (384, 128)}  # canonical rows inside the fused qkv_proj
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def manifest(entries: tuple[PlacedEntry, ...], nbytes: int) -> Manifest:
    bucket = BucketRecord(0, "bfloat16", nbytes, {"kind": "SharedMemory"})
    return Manifest("j", "ns", 1, 1, "GPU-x", "1", "SharedMemory", Producer(0, 0, 1, "h"), (bucket,), entries)


def fused(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, H, generator=g) * torch.logspace(-3, 0, 512).unsqueeze(-1)
    x[300, 7] = float("nan")
    x[0:128, 128:] = 0.0
    return x.to(torch.bfloat16)


def engine() -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """SGLang's fused e4m3 qkv_proj and its scales; the canonical targets (views) and their scale views."""
    weight = torch.full((512, H), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.full((4, 2), -1.0)
    targets = {f"{p}.weight": weight[r : r + n] for p, (r, n) in PARTS.items()}
    scales = {f"{p}.weight": scale[r // 128 : (r + n) // 128] for p, (r, n) in PARTS.items()}
    return weight, scale, targets, scales


def packed(src: torch.Tensor) -> tuple[torch.Tensor, tuple[PlacedEntry, ...]]:
    """q, k, v packed one after another (with a gap) in one BF16 bucket."""
    flat = torch.zeros(600 * H, dtype=torch.bfloat16)
    entries, at = [], 64
    for p, (r, n) in PARTS.items():
        flat[at : at + n * H] = src[r : r + n].flatten()
        entries.append(PlacedEntry(f"{p}.weight", "bfloat16", (n, H), 0, 2 * at, 2 * n * H))
        at += n * H + 8
    return flat.view(torch.uint8), tuple(entries)


def run(program, flat: torch.Tensor, targets: dict) -> None:  # type: ignore[no-untyped-def]
    program.copy_bucket(0, lambda i: flat)
    program.copy_sharded(lambda i: flat, targets, {})


@pytest.mark.parametrize("device", [None, KERNEL_ON_CPU], ids=["torch", "kernel"])
def test_packed_entries_quantized_into_fused_weight(device: torch.device | None) -> None:
    src = fused()
    flat, entries = packed(src)
    weight, scale, targets, scales = engine()
    program = compile_program(manifest(entries, flat.numel()), targets, {}, device, scales)
    assert (program.fp8 is not None) and bool(program.fp8.fp8_tables) == (device is not None)
    run(program, flat, targets)
    rq, rs = fp8_block.quantize(src)
    assert torch.equal(scale.view(torch.int32), rs.view(torch.int32))
    assert torch.equal(weight.view(torch.uint8), rq.view(torch.uint8))
    assert program.covered == {f"{p}.weight": n * H for p, (_, n) in PARTS.items()}


@pytest.mark.parametrize("device", [None, KERNEL_ON_CPU], ids=["torch", "kernel"])
def test_in_place_interleaved_views(device: torch.device | None) -> None:
    """Megatron-style storage [q_g0; k_g0; q_g1; k_g1] (one 128-row head each): the q entry is a strided view
    whose row blocks lie 256 rows apart; every block's rows are still evenly spaced."""
    src = fused(seed=1)[:384]  # q (256 rows) and k (128 rows)
    k2 = torch.zeros(128, H, dtype=torch.bfloat16)
    storage = torch.cat([src[0:128], src[256:384], src[128:256], k2]).flatten()
    q = PlacedEntry(
        "q.weight", "bfloat16", (256, H), 0, 0, 2 * 256 * H, None, ((2, 128, H), (2 * 128 * H, H, 1))
    )
    k = PlacedEntry("k.weight", "bfloat16", (128, H), 0, 2 * 128 * H, 2 * 128 * H, None, ((128, H), (H, 1)))
    weight, scale, targets, scales = engine()
    del targets["v.weight"], scales["v.weight"]
    flat = storage.view(torch.uint8)
    program = compile_program(manifest((q, k), flat.numel()), targets, {}, device, scales)
    assert program.gather is not None
    run(program, flat, targets)
    rq, rs = fp8_block.quantize(src)
    assert torch.equal(weight[:384].view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(scale[:3].view(torch.int32), rs.view(torch.int32))


def test_trainer_shard_cutting_a_block_is_refused() -> None:
    """q split at row 192 by the trainer (two entries): block 1 (rows 128..255) straddles them."""
    src = fused(seed=2)
    flat = torch.zeros(600 * H, dtype=torch.bfloat16)
    flat[: 256 * H] = src[:256].flatten()
    shards = [
        TensorShard("q.weight", (256, H), "bfloat16", Box((0, 0), (192, H))),
        TensorShard("q.weight", (256, H), "bfloat16", Box((192, 0), (64, H))),
    ]
    entries = (
        PlacedEntry("q.weight", "bfloat16", (192, H), 0, 0, 2 * 192 * H, shards[0]),
        PlacedEntry("q.weight", "bfloat16", (64, H), 0, 2 * 192 * H, 2 * 64 * H, shards[1]),
    )
    _, _, targets, scales = engine()
    targets = {"q.weight": targets["q.weight"]}
    with pytest.raises(StepFailed, match=r"rows 0\.\.192 of 256 cut a 128-block"):
        compile_program(
            manifest(entries, flat.numel() * 2), targets, {}, None, {"q.weight": scales["q.weight"]}
        )


def test_fp8_target_without_scales_is_a_dtype_mismatch() -> None:
    flat, entries = packed(fused())
    _, _, targets, _ = engine()
    with pytest.raises(StepFailed, match="the parameter is float8_e4m3fn"):
        compile_program(manifest(entries, flat.numel()), targets, {}, None)
