"""Two real processes (trainer writer, inference reader) through a real Redis and shared memory, and the
faults that need a process kill."""

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
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.outcome import PeerLost
from colocate_runtime.colocated.wiring import new_reader, new_writer
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_env

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    return shm_env(
        redis_server,
        tmp_path / "shm",
        COLOCATE_STEP_TIMEOUT_SECONDS="30",
        COLOCATE_BUCKET_MB="1",
        COLOCATE_VERIFY="SampledChecksum",
    )


def spawn(role: str, env: dict[str, str], out: Path, *args: str) -> subprocess.Popen:
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log = open(out.with_suffix(f".{role}.log"), "ab")  # noqa: SIM115 (handed to the child)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.colocated_procs", role, "--out", str(out), *args],
        cwd=REPO,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    return proc


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"process exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} not written in time"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_trainer_and_reader_processes_agree_bitwise_on_every_step(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "steps.jsonl"
    reader = spawn("reader", env, out, "--steps", "3")
    trainer = spawn("trainer", env, out, "--steps", "3")
    assert finish(trainer) == 0 and finish(reader) == 0, (tmp_path / "steps.reader.log").read_text()[-3000:]
    got = lines(out)
    assert [(r["step"], r["ok"]) for r in got if r["role"] == "trainer"] == [(1, True), (2, True), (3, True)]
    assert [(r["step"], r["ok"], r["wrong"]) for r in got if r["role"] == "reader"] == [
        (1, True, []),
        (2, True, []),
        (3, True, []),
    ]
    assert all(r["handles"] == 2 for r in got if r["role"] == "trainer")
    assert list(Path(env["COLOCATE_SHM_DIR"]).iterdir()) == []


def test_consumer_killed_mid_step_producer_frees_after_heartbeat_expiry(
    env: dict[str, str], tmp_path: Path
) -> None:
    cfg = ColocateConfig.from_env(env)
    out, marker = tmp_path / "steps.jsonl", tmp_path / "opened"
    reader = spawn("reader", env, out, "--steps", "1", "--pause-on-open", "1", "--marker", str(marker))
    writer = new_writer(cfg)
    try:
        pending = writer.publish(1, model.weights(1))
        wait_file(marker, reader)  # the reader holds a mapping of step 1 now
        reader.send_signal(signal.SIGKILL)
        reader.wait()
        t0 = time.monotonic()
        with pytest.raises(PeerLost) as err:
            writer.wait_and_free(pending)
        assert err.value.freed is True
        assert time.monotonic() - t0 < cfg.heartbeat_ttl_s + 3  # bounded by the TTL, not the step timeout
        assert list(Path(cfg.shm_dir).iterdir()) == []
        events = [e for _, e in writer.store.read_events() if e.phase == "failed"]
        assert events and events[-1].result == "peer_lost"
    finally:
        writer.close()


def test_producer_killed_reader_reports_it_and_follows_the_next_incarnation(
    env: dict[str, str], tmp_path: Path
) -> None:
    cfg = ColocateConfig.from_env(env)
    out, marker = tmp_path / "steps.jsonl", tmp_path / "published"
    targets = model.targets()
    reader = new_reader(cfg, targets)
    try:
        trainer = spawn(
            "trainer", env, out, "--steps", "2", "--hold-after-publish", "2", "--marker", str(marker)
        )
        first = reader.apply_next(timeout_s=60)
        assert first.step == 1 and model.all_equal(model.weights(1), targets) == []
        wait_file(marker, trainer)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        # Step 2 was published before the kill: the reader may still apply it, but then sees the death.
        second = reader.apply_next(timeout_s=10)
        assert second.step == 2 and model.all_equal(model.weights(2), targets) == []
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="trainer"):
            reader.apply_next(timeout_s=20)
        assert time.monotonic() - t0 < cfg.heartbeat_ttl_s + 3
        # A restarted trainer is a new incarnation; the reader follows it and ignores the old keys.
        restarted = spawn("trainer", env, out, "--steps", "1")
        third = reader.apply_next(timeout_s=60)
        assert third.gen == first.gen + 1 and third.step == 1
        assert model.all_equal(model.weights(1), targets) == []
        assert finish(restarted) == 0
    finally:
        reader.close()
