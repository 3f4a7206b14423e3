"""The SGLang adapter against the SGLang STAND-IN (runtime/sglang/standin.py): tag tracking, bounded retries,
and a full colocated cycle with the reader running inside the stand-in server process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient, SGLangError
from colocate_runtime.sglang.loader import LOADER_PATH
from colocate_runtime.sglang.rollout import ColocatedRollout, json_payload
from colocate_runtime.sglang.standin import StandinState, TinyLM, serve
from tests.runtime.redis_fixture import RedisServer, free_port, redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(120)
FAST = HttpPolicy(timeout_s=5, update_timeout_s=30, retries=3, backoff_s=0.05, max_backoff_s=0.2)
NOOP_LOADER = "noop"


@pytest.fixture
def standin() -> Iterator[tuple[StandinState, SGLangClient]]:
    state = StandinState(TinyLM(), {NOOP_LOADER: lambda model, named: None})
    server = serve(state)
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", FAST)
    yield state, client
    server.shutdown()
    server.server_close()


def test_release_and_resume_are_tracked_so_repeats_are_safe(standin) -> None:
    state, client = standin
    assert client.release_memory_occupation(None) == ["kv_cache", "weights", "cuda_graph"]
    assert client.release_memory_occupation(["weights"]) == []  # already released: no call at all
    assert client.release_memory_occupation(None) == []
    assert state.calls.count("/release_memory_occupation") == 1
    assert client.resume_memory_occupation(["weights"]) == ["weights"]
    assert client.resume_memory_occupation(["weights"]) == []
    assert client.resume_memory_occupation(None) == ["kv_cache", "cuda_graph"]
    assert client.resume_memory_occupation(None) == []
    assert state.calls.count("/resume_memory_occupation") == 2 and state.released == set()
    # Without the tracking the engine is asked twice, which SGLang itself may not survive.
    raw = requests.post(
        f"{client.base_url}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=5
    )
    assert raw.ok
    raw = requests.post(
        f"{client.base_url}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=5
    )
    assert raw.status_code == 500
    with pytest.raises(ValueError, match="unknown memory tags"):
        client.release_memory_occupation(["everything"])


def test_pause_continue_and_version(standin) -> None:
    state, client = standin
    client.pause_generation("retract")
    client.pause_generation("retract")
    assert state.paused and state.calls.count("/pause_generation") == 1
    client.flush_cache()
    client.update_weight_version("v7")
    assert client.get_weight_version() == "v7"
    client.continue_generation()
    client.continue_generation()
    assert not state.paused and state.calls.count("/continue_generation") == 1
    with pytest.raises(SGLangError, match="cannot flush"):
        client.flush_cache()  # the engine refuses while requests may run: surfaced, not retried forever


def test_bounded_retries_and_refusals(standin) -> None:
    state, client = standin
    state.faults["/flush_cache"] = 2
    client.pause_generation()
    client.flush_cache()  # two 503s, then success
    assert state.calls.count("/flush_cache") == 3
    state.faults["/release_memory_occupation"] = 10
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="503"):
        client.release_memory_occupation(["kv_cache"])
    assert state.calls.count("/release_memory_occupation") == FAST.retries + 1 and time.monotonic() - t0 < 3
    assert client.released == set()  # a refused release is not recorded as done
    state.faults["/release_memory_occupation"] = 0
    client.release_memory_occupation(["weights"])
    with pytest.raises(SGLangError, match="resume the 'weights' tag"):
        client.update_weights_from_tensor([json_payload(0)], load_format=NOOP_LOADER)
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", FAST)
    t0 = time.monotonic()
    with pytest.raises(SGLangError):
        dead.pause_generation()  # connection refused: retried (it never reached a server), then an error
    assert time.monotonic() - t0 < 3 and not dead.paused


@pytest.fixture
def colocated_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:  # noqa: F811
    return {
        "COLOCATE_JOB_NAME": "rl-job",
        "COLOCATE_NAMESPACE": "team-a",
        **redis_server.env(),
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(tmp_path / "shm"),
        "COLOCATE_STEP_TIMEOUT_SECONDS": "30",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "2",
        "COLOCATE_VERIFY": "SampledChecksum",
    }


def test_colocated_cycle_updates_the_standin_model_in_its_own_process(
    colocated_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    log = open(tmp_path / "standin.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colocate_runtime.sglang.standin",
            "--port",
            str(port),
            "--custom-weight-loader",
            LOADER_PATH,
        ],
        env={**os.environ, **colocated_env, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    cfg = ColocateConfig.from_env(colocated_env)
    writer = new_writer(cfg)
    client = SGLangClient(f"http://127.0.0.1:{port}", FAST)
    rollout = ColocatedRollout(client, payload=json_payload)
    try:
        client.wait_ready(60)
        prompt = [1, 2, 3, 4]
        for step in (1, 2, 3):
            trained = TinyLM(seed=100 + step)
            rollout.before_training()
            assert client.released == {"kv_cache", "weights", "cuda_graph"} and client.paused
            pending = writer.publish(step, dict(trained.named_parameters()), weight_version=f"v{step}")
            rollout.install_weights(f"v{step}")  # returns once the stand-in's reader has ACKed
            report = writer.wait_and_free(pending)
            assert report.step == step and not client.released and not client.paused
            assert client.get_weight_version() == f"v{step}"
            for name, p in trained.named_parameters():
                got = torch.tensor(client.get_weights_by_name(name, truncate_size=10_000))
                assert torch.equal(got, p.detach().float().reshape(-1)), name
            out = requests.post(
                f"{client.base_url}/generate",
                json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}},
                timeout=10,
            ).json()
            assert out["output_ids"] == trained.greedy(prompt, 6)
            assert out["meta_info"]["weight_version"] == f"v{step}"
        assert list(Path(cfg.shm_dir).iterdir()) == []
    finally:
        writer.close()
        proc.kill()
        proc.wait()
