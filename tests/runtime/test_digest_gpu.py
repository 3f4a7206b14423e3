"""The weights check on the GPU: its kernel against the torch path, and a corrupt bucket caught in its step
between two processes over real CUDA IPC. On the H200:
`bash bench/colocated_device.sh pytest tests/runtime/test_digest_gpu.py -m gpu`. The cost per step is
bench/step_bench.py's (`--digest on off`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.outcome import WeightsMismatch
from colocate_runtime.colocated.wiring import new_writer
from tests.runtime import colocated_model as model
from tests.runtime.test_colocated_gpu import records, spawn_reader
from tests.runtime.test_digest import corrupt_after_hashing, kernel_matches_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_kernel_computes_what_the_torch_path_does() -> None:
    torch.cuda.set_device(0)
    kernel_matches_torch()


@pytest.fixture
def env(redis_server: RedisServer) -> dict[str, str]:
    return {
        "COLOCATE_JOB_NAME": "gpu-digest",
        "COLOCATE_NAMESPACE": "test",
        **redis_server.env(),
        "COLOCATE_TRANSPORT": "CudaIPC",
        "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "5",
        "COLOCATE_BUCKET_MB": "64",
    }


def test_a_corrupt_bucket_is_caught_in_its_step_over_cuda_ipc(env: dict[str, str], tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    out = tmp_path / "reader.jsonl"
    reader = spawn_reader(env, out, "small", steps=3)
    writer = new_writer(ColocateConfig.from_env(env), device=0)
    name = "model.layers.0.mlp.down_proj.weight"
    try:
        assert writer.update(1, model.weights(1, "cuda:0", scale=64)).step == 1
        corrupt_after_hashing(writer, 2, name)
        with pytest.raises(WeightsMismatch) as err:
            writer.update(2, model.weights(2, "cuda:0", scale=64))
        assert err.value.parameters == (name,) and err.value.freed
        assert writer.update(3, model.weights(3, "cuda:0", scale=64)).step == 3
        assert reader.wait(timeout=120) == 0, out.with_suffix(".log").read_text()[-4000:]
    finally:
        writer.close()
        if reader.poll() is None:
            reader.kill()
    got = records(out)
    assert [r.get("step") for r in got] == [1, None, 3] and got[0]["ok"] and got[2]["ok"]
    assert "weights check failed" in got[1]["error"] and name in got[1]["error"]
    assert "digest" in got[2]["seconds"]
