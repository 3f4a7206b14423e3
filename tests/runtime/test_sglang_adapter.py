"""The SGLang adapter against the SGLang STAND-IN (runtime/sglang/standin.py), which follows the same
per-version table as the client: tag tracking, bounded retries, the version table, a failed step that keeps
generation paused, and a full colocated cycle with the reader running inside the stand-in server process.
SGLang's own code runs in tests/sglang_real/."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import requests
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.sglang import versions
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient, SGLangError
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, ColocatedRollout, StepNotInstalled
from colocate_runtime.sglang.standin import StandinState, TinyLM, serve

pytestmark = pytest.mark.timeout(120)
FAST = HttpPolicy(timeout_s=5, update_timeout_s=30, retries=3, backoff_s=0.05, max_backoff_s=0.2)
NOOP_LOADER = "noop"


@pytest.fixture(params=versions.PINNED)
def standin(request: pytest.FixtureRequest) -> Iterator[tuple[StandinState, SGLangClient]]:
    state = StandinState(TinyLM(), {NOOP_LOADER: lambda model, named: None}, version=request.param)
    server = serve(state)
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", FAST)
    yield state, client
    server.shutdown()
    server.server_close()


def test_version_table_rows_and_refusals() -> None:
    old, mid, new = versions.traits("0.5.10"), versions.traits("0.5.20.post1"), versions.traits("0.5.23")
    assert (old.session, old.plugins, old.pause_mode) == (False, False, "abort")
    assert (mid.session, mid.plugins, mid.pause_mode) == (False, True, "abort")
    assert (new.session, new.plugins, new.pause_mode) == (True, True, "retract")
    with pytest.raises(
        versions.UnsupportedEngine, match=r"SGLang 0\.5\.9 is not supported.*0\.5\.10 to 0\.5\.23"
    ):
        versions.traits("0.5.9")
    with pytest.raises(versions.UnsupportedEngine, match="allow_untested"):
        versions.traits("0.6.0")
    assert versions.traits("0.6.0", allow_untested=True).session
    with pytest.raises(versions.UnsupportedEngine, match="not a version number"):
        versions.traits("main")


def test_client_detects_the_version_and_refuses_an_unsupported_one(standin) -> None:
    state, client = standin
    assert client.detect().version == state.engine.version
    assert client.ready()  # /model_info answers
    stale = SGLangClient(client.base_url, FAST)
    state.server_info = lambda body: (200, {"version": "0.4.9"})  # type: ignore[method-assign]
    with pytest.raises(versions.UnsupportedEngine, match=r"0\.4\.9 is not supported"):
        stale.detect()


def test_session_where_the_version_needs_it(standin) -> None:
    state, client = standin
    raw = requests.post(
        f"{client.base_url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [EMPTY_PAYLOAD], "load_format": NOOP_LOADER},
        timeout=5,
    )
    assert raw.ok != state.engine.session  # refused outside a session exactly where SGLang refuses it
    client.update_weights_from_tensor([EMPTY_PAYLOAD], load_format=NOOP_LOADER, weight_version="v2")
    assert client.get_weight_version() == "v2"
    sessions = state.calls.count("/begin_weight_update"), state.calls.count("/end_weight_update")
    assert sessions == ((1, 1) if state.engine.session else (0, 0))
    assert not state.session


def test_a_raising_loader_kills_the_standin_as_it_kills_sglang(standin) -> None:
    state, client = standin
    state.loaders["boom"] = lambda model, named: (_ for _ in ()).throw(RuntimeError("reader failed"))
    with pytest.raises(SGLangError):
        client.update_weights_from_tensor([EMPTY_PAYLOAD], load_format="boom")
    assert state.crashed and "reader failed" in state.crashed
    assert not client.ready()  # nothing answers any more


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
    with pytest.raises(ValueError, match="unknown memory tags"):
        client.release_memory_occupation(["everything"])
    # Without the tracking the engine is asked twice, which SGLang does not survive.
    raw = requests.post(
        f"{client.base_url}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=5
    )
    assert raw.ok
    with pytest.raises(requests.ConnectionError):
        requests.post(f"{client.base_url}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=5)
    assert state.crashed


def test_pause_continue_and_version(standin) -> None:
    state, client = standin
    client.pause_generation()
    client.pause_generation()
    assert state.paused and state.calls.count("/pause_generation") == 1
    assert client.ready() and not client.health()  # /health generates: it fails while paused
    client.flush_cache()
    client.update_weight_version("v7")
    assert client.get_weight_version() == "v7"
    client.continue_generation()
    client.continue_generation()
    assert not state.paused and state.calls.count("/continue_generation") == 1
    with pytest.raises(SGLangError, match="Cache not flushed"):
        client.flush_cache()  # the engine refuses while requests may run: surfaced, not retried forever
    assert client.get_weights_by_name("norm", truncate_size=3) == [1.0, 1.0, 1.0]  # SGLang's bare list


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
        client.update_weights_from_tensor([EMPTY_PAYLOAD], load_format=NOOP_LOADER)
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", FAST)
    t0 = time.monotonic()
    with pytest.raises(SGLangError):
        dead.pause_generation()  # connection refused: retried (it never reached a server), then an error
    assert time.monotonic() - t0 < 3 and not dead.paused


@pytest.mark.parametrize("carry", [True, False], ids=["retried-onto-the-new-engine", "fails-on-the-dead-one"])
def test_a_pause_refused_while_sglang_restarts_reaches_the_new_engine_only_when_allowed(carry: bool) -> None:
    port = free_port()
    state = StandinState(TinyLM(), {}, version=versions.PINNED[-1])
    servers: list = []
    comes_up = threading.Timer(0.3, lambda: servers.append(serve(state, port=port)))  # the restarted engine
    policy = HttpPolicy(
        timeout_s=5, retries=4, backoff_s=0.25, max_backoff_s=0.5, retry_unsent_effectful=carry
    )
    client = SGLangClient(f"http://127.0.0.1:{port}", policy)
    comes_up.start()
    try:
        if carry:
            client.pause_generation("retract")  # refused, retried: the new engine is paused
            assert state.paused and client.paused
        else:
            with pytest.raises(SGLangError, match="pause_generation: ConnectionError"):
                client.pause_generation("retract")  # a mode: no version lookup, which would wait
            comes_up.join()
            assert client.ready() and not state.paused and not client.paused
            assert state.calls.count("/pause_generation") == 0
    finally:
        comes_up.join()
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def colocated_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
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


def _spawn_standin(env: dict[str, str], port: int, log_path: Path, version: str) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colocate_runtime.sglang.standin",
            "--port",
            str(port),
            "--custom-weight-loader",
            LOADER_PATH,
            INIT_LOADER_PATH,
            "--sglang-version",
            version,
        ],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    return proc


def _assert_serves(client: SGLangClient, trained: TinyLM, version: str) -> None:
    assert client.get_weight_version() == version
    for name, p in trained.named_parameters():
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=10_000))
        assert torch.equal(got, p.detach().float().reshape(-1)), name
    prompt = [1, 2, 3, 4]
    out = requests.post(
        f"{client.base_url}/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}},
        timeout=10,
    ).json()
    assert out["output_ids"] == trained.greedy(prompt, 6)
    assert out["meta_info"]["weight_version"] == version


@pytest.mark.parametrize("version", versions.PINNED)
def test_colocated_cycle_updates_the_standin_model_in_its_own_process(
    colocated_env: dict[str, str], tmp_path: Path, version: str
) -> None:
    port = free_port()
    proc = _spawn_standin(
        {**colocated_env, "COLOCATE_IPC_PREFLIGHT": "Wait"}, port, tmp_path / "s.log", version
    )
    cfg = ColocateConfig.from_env({**colocated_env, "COLOCATE_IPC_PREFLIGHT": "Wait"})
    client = SGLangClient(f"http://127.0.0.1:{port}", FAST)
    rollout = ColocatedRollout(client)
    writer = None
    try:
        client.wait_ready(60)
        rollout.start()  # the init call starts the stand-in's preflight responder
        writer = new_writer(cfg)  # returns once the preflight passed
        assert writer.preflight_passed
        for step in (1, 2, 3):
            trained = TinyLM(seed=100 + step)
            rollout.before_training()
            assert client.released == {"kv_cache", "weights", "cuda_graph"} and client.paused
            pending = writer.publish(step, dict(trained.named_parameters()), weight_version=f"v{step}")
            report = rollout.install_weights(f"v{step}", confirm=partial(writer.wait_and_free, pending))
            assert report.step == step and not client.released and not client.paused
            _assert_serves(client, trained, f"v{step}")
        assert list(Path(cfg.shm_dir).iterdir()) == []
    finally:
        if writer is not None:
            writer.close()
        proc.kill()
        proc.wait()


def test_weights_kept_resident_are_written_in_place_and_never_released(
    colocated_env: dict[str, str], tmp_path: Path
) -> None:
    """`release_weights=False`: training gets the KV cache and CUDA graphs only; the weights are written while
    resident (the stand-in, like SGLang, would die on resuming a tag that is not released)."""
    env = {**colocated_env, "COLOCATE_IPC_PREFLIGHT": "Wait"}
    port = free_port()
    proc = _spawn_standin(env, port, tmp_path / "s.log", versions.PINNED[-1])
    client = SGLangClient(f"http://127.0.0.1:{port}", FAST)
    rollout = ColocatedRollout(client, release_weights=False)
    writer = None
    try:
        client.wait_ready(60)
        rollout.start()
        writer = new_writer(ColocateConfig.from_env(env))
        for step in (1, 2):
            trained = TinyLM(seed=300 + step)
            rollout.before_training()
            assert client.released == {"kv_cache", "cuda_graph"} and client.paused
            pending = writer.publish(step, dict(trained.named_parameters()), weight_version=f"v{step}")
            rollout.install_weights(f"v{step}", confirm=partial(writer.wait_and_free, pending))
            assert not client.released and not client.paused and proc.poll() is None
            _assert_serves(client, trained, f"v{step}")
    finally:
        if writer is not None:
            writer.close()
        proc.kill()
        proc.wait()


def test_a_failed_step_keeps_generation_paused_and_the_next_one_installs(
    colocated_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**colocated_env, "COLOCATE_STEP_TIMEOUT_SECONDS": "2"}
    port = free_port()
    proc = _spawn_standin(env, port, tmp_path / "s.log", versions.PINNED[-1])
    cfg = ColocateConfig.from_env(env)
    client = SGLangClient(f"http://127.0.0.1:{port}", FAST)
    rollout = ColocatedRollout(client)
    writer = new_writer(cfg)
    try:
        client.wait_ready(60)
        rollout.start()
        first = TinyLM(seed=1)
        rollout.before_training()
        pending = writer.publish(1, dict(first.named_parameters()), weight_version="v1")
        rollout.install_weights("v1", confirm=partial(writer.wait_and_free, pending))
        # Step 2 comes too late: the reader inside the engine times out (the loader must not raise, or the
        # server dies), the engine answers, and the trainer's writer gives up on the step it then publishes.
        rollout.before_training()
        late = TinyLM(seed=2)
        with pytest.raises(StepNotInstalled, match="StepTimedOut"):
            rollout.install_weights(
                "v2",
                confirm=lambda: writer.wait_and_free(writer.publish(2, dict(late.named_parameters()))),
            )
        assert proc.poll() is None and client.ready() and client.paused
        assert client.get_weight_version() == "v1"  # the version is not moved by a failed step
        third = TinyLM(seed=3)
        pending = writer.publish(3, dict(third.named_parameters()), weight_version="v3")
        report = rollout.install_weights("v3", confirm=partial(writer.wait_and_free, pending))
        assert report.step == 3 and not client.paused and not client.released
        _assert_serves(client, third, "v3")
    finally:
        writer.close()
        proc.kill()
        proc.wait()


def test_api_key_is_sent_and_an_anonymous_caller_is_refused() -> None:
    state = StandinState(TinyLM(), {NOOP_LOADER: lambda model, named: None}, api_key="k-123")
    server = serve(state)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        client = SGLangClient(url, FAST, api_key="k-123")
        client.update_weights_from_tensor([EMPTY_PAYLOAD], load_format=NOOP_LOADER, weight_version="v1")
        assert client.get_weight_version() == "v1" and client.health()
        anonymous = SGLangClient(url, FAST)
        assert anonymous.health()  # probes need no key, as in SGLang
        with pytest.raises(SGLangError, match="401"):
            anonymous.detect()
        cfg = ColocateConfig.from_env({**_ENV, "SGLANG_API_KEY": "k-123"})
        assert cfg.sglang_api_key == "k-123" and "k-123" not in repr(cfg)
    finally:
        server.shutdown()
        server.server_close()


_ENV = {
    "COLOCATE_JOB_NAME": "j",
    "COLOCATE_NAMESPACE": "n",
    "COLOCATE_METASTORE_ADDR": "127.0.0.1:6379",
    "COLOCATE_METASTORE_PASSWORD": "p",
}


def test_a_hung_engine_is_a_bounded_clear_error(standin) -> None:
    state, client = standin
    quick = SGLangClient(client.base_url, HttpPolicy(timeout_s=0.5, retries=2, backoff_s=0.05))
    quick.detect()
    state.hangs["/update_weight_version"] = 3.0
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="/update_weight_version: ReadTimeout"):
        quick.update_weight_version("v9")  # effectful: not repeated, it may have taken effect
    assert time.monotonic() - t0 < 2 and state.calls.count("/update_weight_version") == 1
    state.hangs["/model_info"] = 3.0
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match="/model_info: ReadTimeout"):
        quick.get_weight_version()  # a read: retried, within its bounded budget
    assert time.monotonic() - t0 < 3 and state.calls.count("/model_info") == 3
