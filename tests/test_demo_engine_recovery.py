"""Engine recovery with the demo's own processes (no cluster needed): the demo trainer (demo/trainer.py) and
the SGLang stand-in with the colocated loader, weights through a real redis-server on the shared-memory path.
The SGLang side is SIGKILLed mid-run and started again, as the kubelet restarts that container alone; the
trainer, never restarted, pushes its current weights to the new engine (the last step again, no training
step), which then holds them bit for bit, and training goes on to the last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.colocated.keys import KeySchema
from tests.kube import wait_for

ROOT = Path(__file__).resolve().parents[1]
LOADER = "colocate_runtime.sglang.loader.load_colocated_step"
INIT_LOADER = "colocate_runtime.sglang.loader.start_colocated"
STEPS = 5
KILL_AFTER = 2  # steps

pytestmark = pytest.mark.integration


def pod_env(redis: RedisServer, port: int, shm: Path) -> dict[str, str]:
    """What the operator puts into both containers of one pod (the variables the runtime reads)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("COLOCATE_")}
    return {
        **base,
        "COLOCATE_JOB_NAME": "demo",
        "COLOCATE_NAMESPACE": "demo",
        "COLOCATE_REPLICA_INDEX": "0",
        "COLOCATE_METASTORE_ADDR": redis.addr,
        "COLOCATE_METASTORE_PASSWORD": redis.password,
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(shm),
        "COLOCATE_SGLANG_URL": f"http://127.0.0.1:{port}",
        "COLOCATE_STEP_TIMEOUT_SECONDS": "15",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "3",
        "COLOCATE_IPC_PREFLIGHT": "Off",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "DEMO_STEPS": str(STEPS),
        "DEMO_STEP_SECONDS": "0.2",
    }


def start_engine(
    env: dict[str, str], port: int, log: Path, crash_at: dict[str, int] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "colocate_runtime.sglang.standin",
                "--port",
                str(port),
                "--run-plugins",  # as SGLang >= 0.5.11 runs ours at start: the new instance registers
                "--custom-weight-loader",
                LOADER,
                INIT_LOADER,
                "--crash-at",
                json.dumps(crash_at or {}),
            ],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


# Calls of /update_weights_from_tensor: the init call, then one per step: the 4th is step 3's update.
MID_UPDATE = {"/update_weights_from_tensor": KILL_AFTER + 2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mid_update", [False, True], ids=["killed-between-steps", "died-mid-update"])
def test_a_restarted_engine_gets_the_current_weights_without_a_training_restart(
    redis_server: RedisServer, tmp_path: Path, mid_update: bool
) -> None:
    port = free_port()
    shm = tmp_path / "shm"
    shm.mkdir()
    env = pod_env(redis_server, port, shm)
    engine = start_engine(env, port, tmp_path / "engine-1.log", MID_UPDATE if mid_update else None)
    trainer_log = tmp_path / "trainer.log"
    with trainer_log.open("ab") as out:
        trainer = subprocess.Popen(
            [sys.executable, str(ROOT / "demo" / "trainer.py")],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    second = None
    try:
        wait_for(
            lambda: (
                any(r.get("step") == KILL_AFTER for r in lines(trainer_log)) or trainer.poll() is not None
            ),
            150,
            f"trainer step {KILL_AFTER}",
            interval=0.2,
        )
        assert trainer.poll() is None, trainer_log.read_text()[-3000:]
        if mid_update:  # it dies by itself as step 3's update arrives
            engine.wait(60)
        else:
            engine.send_signal(signal.SIGKILL)  # the SGLang container dies alone, between steps
            engine.wait(10)
        time.sleep(1.0)
        second = start_engine(env, port, tmp_path / "engine-2.log")  # the kubelet restarts it in place
        code = trainer.wait(240)
        log = trainer_log.read_text()
        assert code == 0, log[-3000:]
    finally:
        for proc in (trainer, engine, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)

    records = lines(trainer_log)
    steps = [r for r in records if "step" in r]
    repushed = [r for r in records if "repushed" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), log[-3000:]
    assert all(r["rollout_matches_trainer"] for r in steps), steps
    # Once, with the weights of the last step the trainer had installed, bit for bit, from the same process.
    assert len(repushed) == 1, records
    # Between steps: the last installed step's weights (or the next, had the kill come after its publish);
    # mid-update: that step's, which the dead engine never acknowledged.
    assert (
        repushed[0]["repushed"] == KILL_AFTER + 1
        if mid_update
        else repushed[0]["repushed"] in (KILL_AFTER, KILL_AFTER + 1)
    )
    assert repushed[0]["bitwise"] is True
    assert repushed[0]["pid"] == trainer.pid
    assert "error" not in log
    # Two engine instances registered on the GPU; one trainer generation (the trainer never restarted).
    keys = KeySchema("demo", "demo")
    client = redis_server.client()
    uuid = f"CPU-{_host_id()}-0-0"
    assert int(client.get(keys.engine(uuid))) == 2
    assert int(client.get(keys.gen(uuid))) == 1


def _host_id() -> str:
    from colocate_runtime.colocated.liveness import host_id

    return host_id()
