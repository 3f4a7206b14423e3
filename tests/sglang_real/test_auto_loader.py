"""Real SGLang with no user module: the loader wires itself from the trainer records, SGLang's model config
and SGLang's own server arguments.

SGLang 0.5.23 (the newest pinned) at TP 2 on CPU, started with the documented loader flags and nothing of the
job's own (`--custom-weight-loader colocate_runtime.sglang.loader.load_colocated_step
colocate_runtime.sglang.loader.start_colocated`; the test adds only its read-only dump probe, which runs when
the test asks for a dump). Two writer processes (tests/sglang_real/megatron_writer.py), one per GPU, publish
the tiny Qwen3's weights converted from Megatron-core TP 2 state dicts and write their trainer records;
`ColocatedRollout` installs each step. The vocabulary (300) is padded by Megatron to 128 x 2 and by SGLang to
64, so GPU 1's worker needs embedding and lm_head rows published on GPU 0: the automatic wiring must choose
the reshard exchange, over real SGLang's TP group. After every step each worker's parameters (dumped inside
SGLang) equal, bit for bit, what they held before with `inference_plan(...).write` of the reference applied.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.convert import SGLangLayout, inference_plan, model_spec
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, ColocatedRollout
from tests.sglang_real import server
from tests.sglang_real.megatron_writer import reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
VERSION = "0.5.23"
# Where each version keeps the server arguments the loader reads (auto.read_engine_args).
ARGS_SOURCE = {"0.5.23": "runtime_context.get_parallel()", "0.5.10": "server_args.get_global_server_args()"}
TP = 2
DUMP = "tests.sglang_real.probe.dump"
MODEL = {**server.TINY_QWEN3, "vocab_size": 300}
PARALLEL = {"tp": 2, "divisor": 128}  # Megatron's make_vocab_size_divisible_by 128: 300 -> 512 rows
POLICY = HttpPolicy(timeout_s=60, update_timeout_s=180, retries=2, backoff_s=0.2)


@dataclass
class Engine:
    proc: subprocess.Popen
    client: SGLangClient
    env: dict[str, str]  # the COLOCATE_* environment both sides share
    model_dir: Path
    probe_dir: Path
    log: Path

    def params(self) -> list[dict[str, torch.Tensor]]:
        for f in self.probe_dir.glob("params-rank*.pt"):
            f.unlink()
        self.client.update_weights_from_tensor([EMPTY_PAYLOAD] * TP, load_format=DUMP, flush_cache=False)
        return [torch.load(self.probe_dir / f"params-rank{r}.pt") for r in range(TP)]


@pytest.fixture(scope="module")
def engine(module_redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    work = tmp_path_factory.mktemp("sglang-auto")
    colocate = server.colocate_env(
        "auto-loader",
        module_redis_server.env(),
        work,
        COLOCATE_STEP_TIMEOUT_SECONDS="60",
        COLOCATE_HEARTBEAT_TTL_SECONDS="3",
        COLOCATE_IPC_PREFLIGHT="Wait",
    )
    probe_dir = work / "probe"
    probe_dir.mkdir()
    model_dir = work / "model"
    server.write_tiny_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(MODEL, indent=1))
    base = {**os.environ, **colocate, "PYTHONPATH": server.pythonpath(VERSION)}
    base["SGLANG_REAL_PROBE_DIR"] = str(probe_dir)
    port = free_port()
    cmd = server.command(model_dir, port, TP, loaders=(LOADER_PATH, INIT_LOADER_PATH, DUMP))
    log = work / "sglang.log"
    proc = server.launch(cmd, server.environment(TP, base), log)
    client = SGLangClient(f"http://127.0.0.1:{port}", POLICY)
    try:
        client.wait_ready(60)
        yield Engine(proc, client, colocate, model_dir, probe_dir, log)
    finally:
        server.stop(proc)


class Writer:
    """One trainer rank's process (megatron_writer.py), driven line by line."""

    def __init__(self, engine: Engine, rank: int) -> None:
        env = {**os.environ, **engine.env, "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(server.REPO), env.get("PYTHONPATH", "")) if p)
        self.rank = rank
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.sglang_real.megatron_writer",
                "--rank",
                str(rank),
                "--model",
                str(engine.model_dir / "config.json"),
                "--parallel",
                json.dumps(PARALLEL),
                "--megatron-rank",
                json.dumps({"tp_rank": rank}),
            ],
            env=env,
            cwd=server.REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith(word), f"writer {self.rank}: expected {word!r}, got {line!r}"
        return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def expected(before: dict[str, torch.Tensor], rank: int, step: int) -> dict[str, torch.Tensor]:
    """What SGLang's worker `rank` holds after `step`: its parameters before (padding rows stay as SGLang made
    them) with every target box written from the reference by `inference_plan(...).write`."""
    spec = model_spec(MODEL)
    plan = inference_plan(spec, SGLangLayout(tp=TP), rank)
    canonical = reference(spec, step)
    params = {n: t.clone() for n, t in before.items()}
    for shard in plan.shards():
        plan.write(params, shard, canonical[shard.name][shard.box.slices()])
    return params


def test_megatron_pieces_land_in_real_sglang_with_no_user_module(engine: Engine) -> None:
    rollout = ColocatedRollout(engine.client)
    rollout.start()  # the init call: each worker answers its writer's preflight
    before = engine.params()
    writers = [Writer(engine, r) for r in range(TP)]
    try:
        for w in writers:
            w.expect("ready")
        for step in (1, 2, 3):
            rollout.before_training()
            for w in writers:
                w.send(f"step {step}")
                w.expect("published")
            rollout.install_weights(
                f"v{step}", confirm=lambda step=step: [w.expect("acked") for w in writers]
            )
            assert engine.client.get_weight_version() == f"v{step}"
            got = engine.params()
            for r in range(TP):
                want = expected(before[r], r, step)
                assert got[r].keys() == want.keys()
                wrong = [
                    n
                    for n, t in want.items()
                    if not torch.equal(got[r][n].view(torch.uint8), t.view(torch.uint8))
                ]
                assert wrong == [], f"step {step}, worker {r}: {wrong}"
            out = requests.post(
                f"{engine.client.base_url}/generate",
                json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                timeout=60,
            )
            assert out.ok and len(out.json()["output_ids"]) == 3
    finally:
        for w in writers:
            w.close()
    log = engine.log.read_text(errors="replace")
    chosen = [line for line in log.splitlines() if "automatic wiring" in line]
    assert len(chosen) == TP and all("exchange path" in line for line in chosen), chosen
    assert all(f"from {ARGS_SOURCE[VERSION]}" in line for line in chosen), chosen
    assert "lm_head.weight" in chosen[0] or "embed_tokens" in chosen[0], chosen[0]
