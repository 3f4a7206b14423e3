"""Quantize on transfer through the whole protocol: the trainer's writer publishes BF16 weights, a reader
whose engine holds some of them in block FP8 (`new_reader(..., scales=...)`) installs e4m3 values and
`weight_scale_inv` bit-equal to the reference quantizer, and the BF16 ones as sent; step after step. One
process, the reader on a thread, shared-memory buckets, a real Redis (the GPU kernel path is
test_fp8_copy_gpu.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated import fp8_block
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import new_reader, new_writer
from tests.runtime.colocated_env import shm_config
from tests.runtime.test_colocated_protocol import ReaderThread, wait_for

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
SHAPES = {"layers.0.mlp.down_proj.weight": (256, 384), "layers.0.mlp.gate_up_proj.weight": (200, 130)}
NORM = "layers.0.input_layernorm.weight"


@pytest.fixture
def cfg(redis_server: RedisServer, tmp_path: Path) -> ColocateConfig:
    return shm_config(redis_server, tmp_path / "shm", COLOCATE_BUCKET_MB="1")


def trained(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    weights = {
        n: (torch.randn(s, generator=g) * 10.0 ** (step - 3)).to(torch.bfloat16) for n, s in SHAPES.items()
    }
    weights["layers.0.mlp.down_proj.weight"][:128, :128] = 0.0  # an all-zero block
    weights["layers.0.mlp.gate_up_proj.weight"][5, 5] = float("nan")  # a NaN block (its scale NaN too)
    weights[NORM] = torch.randn(384, generator=g).to(torch.bfloat16)
    return weights


def test_bf16_steps_land_quantized_bit_equal_to_the_reference(cfg: ColocateConfig) -> None:
    fmt = fp8_block.BlockFp8()
    held = {n: torch.zeros(s, dtype=torch.float8_e4m3fn) for n, s in SHAPES.items()}
    scales = {n: torch.zeros(fmt.scale_shape(s)) for n, s in SHAPES.items()}
    norm = torch.zeros(384, dtype=torch.bfloat16)
    writer = new_writer(cfg)
    reader = new_reader(cfg, {**held, NORM: norm}, scales=scales, fp8_format=fmt)
    try:
        with ReaderThread(reader) as reading:
            for step in (1, 2, 3):
                weights = trained(step)
                writer.update(step, weights, weight_version=str(step))
                wait_for(lambda s=step: len(reading.reports) == s)
                for name in SHAPES:
                    q, s = fp8_block.quantize(weights[name], fmt)
                    assert torch.equal(held[name].view(torch.uint8), q.view(torch.uint8)), (step, name)
                    assert torch.equal(scales[name].view(torch.int32), s.view(torch.int32)), (step, name)
                assert torch.equal(norm.view(torch.int16), weights[NORM].view(torch.int16))
            assert not reading.errors
    finally:
        writer.close()
