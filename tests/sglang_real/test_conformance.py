"""Conformance tier: our client, `ColocatedRollout` and loader against REAL SGLang, every pinned version.

SGLang's own code here: `sglang.launch_server` as released on PyPI (HTTP server, tokenizer manager, one
scheduler process per TP rank with its TP worker and model runner, the custom-loader dispatch, the
weight-update session, plugin loading), running a tiny random-weight Qwen3 on CPU (`--device cpu`,
torch-native attention), TP 2. Ours or a stand-in: the environment (scripts/sglang-env.sh installs SGLang
with `--no-deps` next to the project's torch, plus the small shims of tests/sglang_real/shims/ for GPU-only
imports never called on CPU), the probe loaders (probe.py), and the transport: shared memory stands in for
CUDA IPC, which needs a GPU. Redis is a real redis-server.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.preflight import PreflightFailed
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.colocated.writer import WeightWriter
from colocate_runtime.contract import events as ev
from colocate_runtime.sglang import versions
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient, SGLangError
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, ColocatedRollout, StepNotInstalled
from tests.sglang_real import server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
TP = 2
DUMP = "tests.sglang_real.probe.dump"
EXCHANGE = "tests.sglang_real.probe.exchange"
FAIL = "tests.sglang_real.probe.fail"
ENGINE_STEP_TIMEOUT_S = 8  # the loader's wait for a step inside SGLang; the trainer's is shorter below
API_KEY = secrets.token_hex(16)  # SGLang runs with --api-key: every call of ours carries it
POLICY = HttpPolicy(timeout_s=60, update_timeout_s=120, retries=2, backoff_s=0.2)


@dataclass
class Engine:
    version: str
    proc: subprocess.Popen
    client: SGLangClient
    env: dict[str, str]  # the COLOCATE_* environment both sides share
    probe_dir: Path
    log: Path

    def cfg(self, **overrides: str) -> ColocateConfig:
        return ColocateConfig.from_env({**self.env, **overrides})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def params(self) -> list[dict[str, torch.Tensor]]:
        """Every TP worker's parameters, as SGLang holds them (through the dump probe, run by SGLang)."""
        for f in self.probe_dir.glob("params-rank*.pt"):
            f.unlink()
        self.client.update_weights_from_tensor([EMPTY_PAYLOAD] * TP, load_format=DUMP, flush_cache=False)
        return [torch.load(self.probe_dir / f"params-rank{r}.pt") for r in range(TP)]


# The pinned bookends run in `make test`; 0.5.17 (the version the GPU tier runs whole on the H200) joins them
# in the slow set (COLOCATE_SLOW_TESTS=1): one more CPU server start, kept out of CI's time budget.
VERSIONS = versions.PINNED + (("0.5.17",) if os.environ.get("COLOCATE_SLOW_TESTS") == "1" else ())


@pytest.fixture(scope="module", params=VERSIONS)
def engine(
    request: pytest.FixtureRequest,
    module_redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Engine]:
    version = request.param
    work = tmp_path_factory.mktemp(f"sglang-{version}")
    colocate = server.colocate_env(
        f"real-{version.replace('.', '-')}",
        module_redis_server.env(),
        work,
        COLOCATE_STEP_TIMEOUT_SECONDS=str(ENGINE_STEP_TIMEOUT_S),
        COLOCATE_HEARTBEAT_TTL_SECONDS="3",
        COLOCATE_IPC_PREFLIGHT="Wait",
        COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS="2",
    )
    probe_dir = work / "probe"
    probe_dir.mkdir()
    port = free_port()
    base = {**os.environ, **colocate, "PYTHONPATH": server.pythonpath(version)}
    base["SGLANG_REAL_PROBE_DIR"] = str(probe_dir)
    env = server.environment(TP, base)
    cmd = server.command(
        server.write_tiny_model(work / "model"),
        port,
        TP,
        loaders=(LOADER_PATH, INIT_LOADER_PATH, DUMP, EXCHANGE, FAIL),
        extra=("--api-key", API_KEY),
    )
    log = work / "sglang.log"
    # Returns once SGLang's own warm-up generation is done: `/model_info` answers before, and a pause then
    # leaves the warm-up request queued (on 0.5.10 the release's idle assert would then kill the scheduler).
    proc = server.launch(cmd, env, log)
    client = SGLangClient(f"http://127.0.0.1:{port}", POLICY, api_key=API_KEY)
    try:
        client.wait_ready(60)
        yield Engine(version, proc, client, colocate, probe_dir, log)
    finally:
        server.stop(proc)


@contextlib.contextmanager
def _writers(engine: Engine, **overrides: str) -> Iterator[list[WeightWriter]]:
    """One started writer per TP rank (the trainer side of each GPU), all closed on the way out."""
    with contextlib.ExitStack() as stack:
        writers = []
        for r in range(TP):
            writers.append(new_writer(engine.cfg(**overrides), rank=r))
            stack.callback(writers[-1].close)
        yield writers


def _trained(held: list[dict[str, torch.Tensor]], seed: int) -> list[dict[str, torch.Tensor]]:
    """New weights for every TP rank, shaped and typed like SGLang's own shards."""
    g = torch.Generator().manual_seed(seed)
    return [
        {n: (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype) for n, t in rank.items()} for rank in held
    ]


def _publish_and_install(
    rollout: ColocatedRollout, writers: list[WeightWriter], weights: list[dict[str, torch.Tensor]], step: int
) -> list:
    pending = [w.publish(step, weights[r], weight_version=f"v{step}") for r, w in enumerate(writers)]
    return rollout.install_weights(
        f"v{step}", confirm=lambda: [w.wait_and_free(p) for w, p in zip(writers, pending, strict=True)]
    )


def _assert_bitwise(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    for r in range(TP):
        assert got[r].keys() == want[r].keys()
        for name, t in want[r].items():
            assert torch.equal(got[r][name].view(torch.uint8), t.view(torch.uint8)), f"rank {r}: {name}"


# --- the tests, in order, on one engine per version --------------------------------------------------------


def test_version_detected_and_the_engine_shape_read(engine: Engine) -> None:
    traits = engine.client.detect()
    assert traits.version == engine.version
    assert traits.session == (versions.parse(engine.version) >= (0, 5, 21))
    info = engine.client.server_info
    assert int(info["tp_size"]) == TP and LOADER_PATH in info["custom_weight_loader"]
    assert engine.client.ready()  # the probe path of this version answers without a generation
    gone = engine.client.session.get(f"{engine.client.base_url}/get_weight_version", timeout=10)
    assert gone.status_code == 404  # deprecated (0.5.10) or removed: the client reads /model_info
    assert API_KEY not in str(info)  # 0.5.10 echoes its keys in /server_info; the client keeps none
    anonymous = requests.post(
        f"{engine.client.base_url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [EMPTY_PAYLOAD] * TP, "load_format": DUMP},
        timeout=10,
    )
    assert anonymous.status_code == 401  # what the key is for: nobody else drives the weight updates


def test_start_answers_the_preflight_before_any_weight_moves(engine: Engine) -> None:
    """Failure 1: SGLang imports a custom loader only at the first update, so nothing answered the trainer's
    preflight and `Wait` waited forever. Now the plugin (>= 0.5.11) or the init call starts every worker."""
    quick = {"COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS": "4"}
    if engine.client.engine.plugins:
        with _writers(engine, **quick) as writers:  # the plugin started the workers: no call to SGLang yet
            assert all(w.preflight_passed for w in writers)
    else:
        with pytest.raises(PreflightFailed, match=ev.PEER_TIMEOUT), _writers(engine, **quick):
            pass  # bounded, and its error says what to do
    ColocatedRollout(engine.client).start()
    with _writers(engine, **quick) as writers:
        assert all(w.preflight_passed for w in writers)
    assert engine.alive()


def test_steps_move_the_trainers_weights_into_sglang_bitwise(engine: Engine) -> None:
    client = engine.client
    rollout = ColocatedRollout(client)
    rollout.start()
    assert rollout.tp_size == TP
    held = engine.params()
    with _writers(engine) as writers:
        for step in (1, 2, 3):
            rollout.before_training()
            assert client.paused and client.released == {"kv_cache", "weights", "cuda_graph"}
            weights = _trained(held, seed=step)
            reports = _publish_and_install(rollout, writers, weights, step)
            assert [r.step for r in reports] == [step] * TP
            assert not client.paused and not client.released
            assert client.get_weight_version() == f"v{step}"
            _assert_bitwise(engine.params(), weights)
            out = client.session.post(
                f"{client.base_url}/generate",
                json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                timeout=60,
            )
            assert out.ok and len(out.json()["output_ids"]) == 3
            assert out.json()["meta_info"]["weight_version"] == f"v{step}"
        # SGLang's Qwen3 has no `get_weights_by_name` (Llama and Qwen2 have): refused, and said so.
        with pytest.raises(SGLangError, match="Get parameter by name failed"):
            client.get_weights_by_name("model.norm.weight", truncate_size=4)
    assert not list(Path(engine.env["COLOCATE_SHM_DIR"]).iterdir())  # every bucket freed


def test_a_step_that_times_out_leaves_sglang_serving_and_the_next_step_installs(engine: Engine) -> None:
    """Failure 2: a loader that raises kills SGLang. Ours reports instead: the server stays up, generation
    stays paused on the failed step, and the next step installs."""
    client = engine.client
    rollout = ColocatedRollout(client)
    rollout.start()
    held = engine.params()
    version_before = client.get_weight_version()
    with _writers(engine, COLOCATE_STEP_TIMEOUT_SECONDS="3") as writers:
        rollout.before_training()
        late = _trained(held, seed=20)
        t0 = time.monotonic()
        with pytest.raises(StepNotInstalled, match="StepTimedOut"):
            # The trainer publishes only after SGLang's workers gave up waiting for the step.
            rollout.install_weights(
                "late",
                confirm=lambda: [w.wait_and_free(w.publish(20, late[r])) for r, w in enumerate(writers)],
            )
        assert time.monotonic() - t0 >= ENGINE_STEP_TIMEOUT_S
        assert engine.alive(), server.tail(engine.log)
        assert client.ready() and client.paused  # answering, and nothing served from half-written weights
        assert client.get_weight_version() == version_before
        weights = _trained(held, seed=21)
        _publish_and_install(rollout, writers, weights, 21)
        assert not client.paused and client.get_weight_version() == "v21"
        _assert_bitwise(engine.params(), weights)
    assert engine.alive()


def test_training_starts_while_a_generation_runs_and_sglang_survives(engine: Engine) -> None:
    """Finding 6: on 0.5.10 a `retract` pause followed by a release kills the scheduler when a request is in
    flight (the release asserts an empty waiting queue). The client pauses in a mode the version survives."""
    client = engine.client
    rollout = ColocatedRollout(client)
    rollout.start()
    held = engine.params()
    answer: list[requests.Response] = []
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    thread = threading.Thread(
        target=lambda: answer.append(
            client.session.post(f"{client.base_url}/generate", json=body, timeout=120)
        )
    )
    seen = len(engine.log.read_text(errors="replace"))
    thread.start()
    deadline = time.monotonic() + 30
    while "Decode batch" not in engine.log.read_text(errors="replace")[seen:]:  # one every 40 tokens
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.1)
    with _writers(engine) as writers:
        rollout.before_training()  # pause (abort before 0.5.21, retract after) and release everything
        assert engine.alive(), server.tail(engine.log)
        weights = _trained(held, seed=30)
        _publish_and_install(rollout, writers, weights, 30)
        thread.join(120)
        assert answer and answer[0].ok  # aborted (finish reason abort) or retracted and finished afterwards
        finish = answer[0].json()["meta_info"]["finish_reason"]["type"]
        assert finish == ("length" if client.engine.pause_mode == "retract" else "abort")
        _assert_bitwise(engine.params(), weights)
    assert engine.alive()


def test_session_where_the_version_needs_it(engine: Engine) -> None:
    """Failure 3: from 0.5.21 SGLang refuses an update outside a weight-update session."""
    raw = engine.client.session.post(
        f"{engine.client.base_url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [EMPTY_PAYLOAD] * TP, "load_format": DUMP, "flush_cache": False},
        timeout=60,
    )
    if engine.client.engine.session:
        assert raw.status_code == 400 and "begin_weight_update" in raw.text
    else:
        assert raw.ok, raw.text
    engine.params()  # through the client, which opens the session where needed
    assert engine.alive()


def test_tp_rank_from_sglangs_group_and_the_exchange_on_a_group_of_its_own(engine: Engine) -> None:
    engine.client.update_weights_from_tensor([EMPTY_PAYLOAD] * TP, load_format=EXCHANGE, flush_cache=False)
    reports = [json.loads((engine.probe_dir / f"exchange-rank{r}.json").read_text()) for r in range(TP)]
    assert [r["rank"] for r in reports] == list(range(TP))
    assert all(r["sum"] == sum(range(TP)) and r["group_size"] == TP and r["own_group"] for r in reports)


def test_last_a_raising_loader_kills_sglang_which_is_why_ours_never_raises(engine: Engine) -> None:
    """What failure 2 was: the same call with a loader that raises ends the real server (runs last)."""
    with pytest.raises(Exception):  # noqa: B017 (the connection drops or the answer is an error)
        engine.client.update_weights_from_tensor([EMPTY_PAYLOAD] * TP, load_format=FAIL, flush_cache=False)
    deadline = time.monotonic() + 60
    while engine.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine.alive(), "SGLang survived a raising loader: the premise of loader.py changed"
    assert "Scheduler hit an exception" in engine.log.read_text(errors="replace")
