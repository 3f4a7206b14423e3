"""IPC preflight on the CPU path: shared-memory buckets, a real Redis, the SGLang side as a real process where
it matters (another process's view of /dev/shm and of the trainer's PID), on a thread where only the
classification is under test."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.colocated import preflight_reader
from colocate_runtime.colocated.config import ColocateConfig, ConfigError
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.colocated.preflight import (
    Offer,
    OfferError,
    PreflightFailed,
    PreflightSettings,
    Verdict,
    decode_offer,
    encode_offer,
    pattern,
)
from colocate_runtime.colocated.preflight_reader import PreflightResponder
from colocate_runtime.colocated.shm import SharedMemoryExporter, SharedMemoryImporter
from colocate_runtime.colocated.transport import TransportError
from colocate_runtime.colocated.wiring import connect, cpu_device_id, new_writer
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.events import StepEvent
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import ColocatedRollout
from colocate_runtime.sglang.standin import TinyLM
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_env

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def base_env(redis_server: RedisServer, shm: Path, mode: str, timeout_s: float) -> dict[str, str]:
    return shm_env(
        redis_server,
        shm,
        COLOCATE_JOB_NAME="pf-job",
        COLOCATE_STEP_TIMEOUT_SECONDS="30",
        COLOCATE_BUCKET_MB="1",
        COLOCATE_IPC_PREFLIGHT=mode,
        COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS=str(timeout_s),
    )


@pytest.fixture
def env_for(redis_server: RedisServer, tmp_path: Path):
    def make(mode: str = "Fail", timeout_s: float = 20.0, shm: str = "shm") -> dict[str, str]:
        return base_env(redis_server, tmp_path / shm, mode, timeout_s)

    return make


def spawn(module: str, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def preflight_events(store: MetaStore, role: str | None = None) -> list[StepEvent]:
    return [e for _, e in store.read_events() if e.phase == "preflight" and (role is None or e.role == role)]


def preflight_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*")) if directory.exists() else []


# --- real processes -----------------------------------------------------------------------------------------


def test_preflight_passes_between_a_trainer_and_a_reader_process_before_the_first_step(
    env_for, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    env = env_for("Wait")
    out = tmp_path / "steps.jsonl"
    for role in ("reader", "trainer"):
        processes.append(
            spawn(
                "tests.runtime.colocated_procs",
                env,
                tmp_path / f"{role}.log",
                role,
                "--steps",
                "2",
                "--out",
                str(out),
            )
        )
    for proc in processes:
        assert proc.wait(timeout=90) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    lines = [line for line in out.read_text().splitlines() if line]
    assert len(lines) == 4 and all('"ok": true' in line for line in lines)
    store = connect(ColocateConfig.from_env(env))
    events = [e for _, e in store.read_events()]
    trainer = [e for e in events if e.role == "trainer"]
    first_publish = next(i for i, e in enumerate(trainer) if e.phase == "published")
    before = [(e.phase, e.result, e.reason) for e in trainer[:first_publish]]
    assert before == [("preflight", "", ""), ("preflight", "ok", ev.PREFLIGHT_PASSED)]
    (answer,) = preflight_events(store, "reader")
    assert (answer.result, answer.reason, answer.gen, answer.gpu) == (
        "ok",
        ev.PREFLIGHT_PASSED,
        1,
        trainer[0].gpu,
    )
    assert not [f for f in preflight_files(tmp_path / "shm") if "preflight" in f]


def test_containers_without_a_shared_shm_fail_with_shm_not_shared(
    env_for, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    # Two shared-memory directories stand for two containers that each have their own /dev/shm.
    processes.append(
        spawn(
            "tests.runtime.preflight_procs",
            env_for("Fail", shm="shm-sglang"),
            tmp_path / "sglang.log",
            "responder",
        )
    )
    cfg = ColocateConfig.from_env(env_for("Fail", shm="shm-trainer"))
    with pytest.raises(PreflightFailed) as failed:
        new_writer(cfg)
    assert failed.value.reason == ev.SHM_NOT_SHARED
    assert "/dev/shm" in str(failed.value) and "shm-sglang" in str(failed.value)
    store = connect(cfg)
    trainer = preflight_events(store, "trainer")
    assert [(e.result, e.reason) for e in trainer] == [("", ""), ("error", ev.SHM_NOT_SHARED)]
    assert "do not share" in trainer[-1].error
    deadline = time.monotonic() + 10
    while not preflight_events(store, "reader"):  # the reader's event follows its verdict
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [e.reason for e in preflight_events(store, "reader")] == [ev.SHM_NOT_SHARED]
    assert preflight_files(tmp_path / "shm-trainer") == []  # verdict says closed: buffer and probe gone


def test_wait_mode_holds_the_first_publish_until_a_reader_appears(
    env_for, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    env = env_for("Wait", timeout_s=1.0)
    cfg = ColocateConfig.from_env(env)
    store = connect(cfg)
    done: list[object] = []

    def trainer() -> None:
        try:
            writer = new_writer(cfg)
            done.append(writer.publish(1, model.weights(1)))
            writer.close()
        except BaseException as err:
            done.append(err)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while len([e for e in preflight_events(store, "trainer") if e.result == "error"]) < 2:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    assert not done, "the writer published before its preflight passed"
    processes.append(spawn("tests.runtime.preflight_procs", env, tmp_path / "sglang.log", "responder"))
    thread.join(timeout=60)
    assert len(done) == 1 and not isinstance(done[0], BaseException), done
    events = [e for _, e in store.read_events() if e.role == "trainer"]
    outcomes = [(e.phase, e.reason) for e in events if e.phase != "preflight" or e.result]
    assert outcomes[-2:] == [("preflight", ev.PREFLIGHT_PASSED), ("published", "")]
    assert {reason for _, reason in outcomes[:-2]} == {ev.PEER_TIMEOUT}


def test_the_sglang_standin_answers_through_the_loader_and_the_step_follows(
    env_for, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    port = free_port()
    env = env_for("Wait")
    processes.append(
        spawn(
            "colocate_runtime.sglang.standin",
            env,
            tmp_path / "standin.log",
            "--port",
            str(port),
            "--custom-weight-loader",
            LOADER_PATH,
            INIT_LOADER_PATH,
        )
    )
    client = SGLangClient(f"http://127.0.0.1:{port}", HttpPolicy(timeout_s=10, retries=2))
    client.wait_ready(60)
    rollout = ColocatedRollout(client)
    rollout.start()  # the init call: the stand-in, like SGLang 0.5.10, starts nothing on its own
    writer = new_writer(ColocateConfig.from_env(env))  # returns once the stand-in's responder answered
    try:
        assert writer.preflight_passed
        trained = TinyLM(seed=7)
        rollout.before_training()
        pending = writer.publish(1, dict(trained.named_parameters()), weight_version="v1")
        report = rollout.install_weights("v1", confirm=lambda: writer.wait_and_free(pending))
        assert report.step == 1 and client.get_weight_version() == "v1"
    finally:
        writer.close()
    (answer,) = preflight_events(writer.store, "reader")
    assert answer.reason == ev.PREFLIGHT_PASSED


# --- one process: the trainer on the main thread, the SGLang side (when there is one) on a thread ----------


@pytest.fixture
def cfg(env_for) -> ColocateConfig:
    return ColocateConfig.from_env(env_for("Fail", timeout_s=5.0))


def writer_for(cfg: ColocateConfig, exporter=None, **preflight: object) -> WeightWriter:
    settings = WriterSettings.from_config(cfg)
    settings = dataclasses.replace(settings, preflight=dataclasses.replace(settings.preflight, **preflight))
    exporter = exporter or SharedMemoryExporter(
        cfg.shm_dir, cpu_device_id(cfg, 0), prefix=f"colocate-{cfg.job}"
    )
    return WeightWriter(connect(cfg), exporter, settings)


@pytest.fixture
def responder_on(cfg: ColocateConfig):
    started: list[PreflightResponder] = []

    def start(importer=None, *, uuid: str | None = None, visible: frozenset[str] | None = None):
        importer = importer or SharedMemoryImporter(
            cfg.shm_dir, uuid or cpu_device_id(cfg, 0), prefix=f"colocate-{cfg.job}"
        )
        responder = PreflightResponder(
            connect(cfg), importer, PreflightSettings.from_config(cfg), replica=0, visible=visible
        ).start()
        started.append(responder)
        return responder

    yield start
    for responder in started:
        responder.stop()


def test_passes_in_process_and_frees_the_buffer(cfg: ColocateConfig, responder_on) -> None:
    responder_on()
    writer = writer_for(cfg)
    writer.start()
    assert writer.preflight_passed
    assert preflight_files(Path(cfg.shm_dir)) == []
    writer.close()


def test_peer_timeout_when_nothing_answers(cfg: ColocateConfig) -> None:
    writer = writer_for(cfg, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(PreflightFailed) as failed:
        writer.start()
    assert failed.value.reason == ev.PEER_TIMEOUT and time.monotonic() - t0 < 5
    assert "ColocatedRollout.start()" in str(failed.value)
    assert preflight_files(Path(cfg.shm_dir)) == []  # nobody claimed it: freed at once
    trainer = preflight_events(writer.store, "trainer")
    assert [(e.result, e.reason) for e in trainer] == [("", ""), ("error", ev.PEER_TIMEOUT)]
    assert not writer.preflight_passed
    writer.close()


def test_wait_mode_gives_up_at_its_deadline(cfg: ColocateConfig) -> None:
    writer = writer_for(cfg, mode="Wait", timeout_s=0.5, wait_s=1.2, retry_s=0.5)
    with pytest.raises(PreflightFailed, match="gave up after") as failed:
        writer.start()
    assert failed.value.reason == ev.PEER_TIMEOUT and failed.value.attempts >= 2
    writer.close()


def test_publish_runs_the_preflight_first_and_publishes_nothing_when_it_fails(cfg: ColocateConfig) -> None:
    writer = writer_for(cfg, timeout_s=0.5)
    writer.start(preflight=False)
    with pytest.raises(PreflightFailed):
        writer.publish(1, model.weights(1))
    assert writer.last_step is None
    assert not [e for _, e in writer.store.read_events() if e.phase == "published"]
    writer.close()


def test_off_mode_runs_no_preflight(cfg: ColocateConfig) -> None:
    writer = writer_for(cfg, mode="Off")
    writer.start()
    writer.publish(1, model.weights(1))
    assert preflight_events(writer.store) == []
    writer.close()


def test_device_uuid_mismatch_when_no_visible_gpu_has_the_trainers_uuid(
    cfg: ColocateConfig, responder_on
) -> None:
    responder_on(uuid="GPU-sglang", visible=frozenset({"GPU-sglang"}))
    exporter = SharedMemoryExporter(cfg.shm_dir, "GPU-trainer", prefix=f"colocate-{cfg.job}")
    writer = writer_for(cfg, exporter)
    with pytest.raises(PreflightFailed) as failed:
        writer.start()
    assert failed.value.reason == ev.DEVICE_UUID_MISMATCH
    assert "GPU-trainer" in failed.value.message and "GPU-sglang" in failed.value.message
    writer.close()


def test_a_worker_that_sees_fewer_gpus_does_not_pre_empt_the_trainers_gpu(
    cfg: ColocateConfig, responder_on
) -> None:
    responder_on(uuid="GPU-other", visible=frozenset({"GPU-other"}))  # a narrowed CUDA_VISIBLE_DEVICES
    responder_on()
    writer = writer_for(cfg)
    writer.start()
    assert writer.preflight_passed
    writer.close()


class _Corrupting(SharedMemoryExporter):
    """Flips one byte after the pattern was written: what the reader maps is not what was exported."""

    def export(self, bucket) -> None:
        super().export(bucket)
        bucket.tensor[123] ^= 0xFF


def test_pattern_mismatch(cfg: ColocateConfig, responder_on) -> None:
    responder_on()
    exporter = _Corrupting(cfg.shm_dir, cpu_device_id(cfg, 0), prefix=f"colocate-{cfg.job}")
    with pytest.raises(PreflightFailed) as failed:
        writer_for(cfg, exporter).start()
    assert failed.value.reason == ev.PATTERN_MISMATCH and "byte 123" in failed.value.message


class _Refusing(SharedMemoryImporter):
    def open(self, descriptor, nbytes) -> torch.Tensor:
        raise TransportError("cudaIpcOpenMemHandle: invalid argument (simulated)")


def test_open_mem_handle_failed(cfg: ColocateConfig, responder_on) -> None:
    responder_on(_Refusing(cfg.shm_dir, cpu_device_id(cfg, 0), prefix=f"colocate-{cfg.job}"))
    with pytest.raises(PreflightFailed) as failed:
        writer_for(cfg).start()
    assert failed.value.reason == ev.OPEN_MEM_HANDLE_FAILED and "simulated" in failed.value.message
    assert preflight_files(Path(cfg.shm_dir)) == []


def test_pid_namespace_not_shared(cfg: ColocateConfig, responder_on, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_reader, "process_gone", lambda pid: True)  # as seen from another namespace
    responder_on()
    with pytest.raises(PreflightFailed) as failed:
        writer_for(cfg).start()
    assert failed.value.reason == ev.PID_NAMESPACE_NOT_SHARED and "shareProcessNamespace" in str(failed.value)


def test_a_restarted_trainer_preflights_again(cfg: ColocateConfig, responder_on) -> None:
    responder = responder_on()
    first = writer_for(cfg)
    first.start()
    first.close()
    second = writer_for(cfg)
    assert second.start() == 2 and second.preflight_passed
    second.close()
    responder.stop()
    ok = [e.gen for e in preflight_events(second.store, "trainer") if e.result == "ok"]
    assert ok == [1, 2]


# --- messages and configuration -----------------------------------------------------------------------------


def _offer(**override: object) -> Offer:
    fields = dict(
        gen=3,
        attempt=2,
        gpu="GPU-a",
        transport="CudaIPC",
        replica=1,
        rank=0,
        pid=42,
        host="pod-0",
        nbytes=1 << 20,
        seed=7,
        token="ab",
        probe="colocate-j-preflight-x",
        descriptor={"kind": "CudaIPC", "handle": b"\x00\x01", "event_handle": None, "storage_offset": 0},
    )
    return Offer(**{**fields, **override})


def test_offer_codec_round_trips_and_rejects_what_it_cannot_trust() -> None:
    offer = _offer()
    assert decode_offer(encode_offer(offer), gen=3, attempt=2, gpu="GPU-a") == offer
    with pytest.raises(OfferError, match="under the key"):
        decode_offer(encode_offer(offer), gen=3, attempt=2, gpu="GPU-b")
    with pytest.raises(OfferError):
        decode_offer(b"\xc1garbage", gen=3, attempt=2, gpu="GPU-a")
    with pytest.raises(OfferError, match="bytes"):
        decode_offer(encode_offer(_offer(nbytes=1 << 40)), gen=3, attempt=2, gpu="GPU-a")
    with pytest.raises(OfferError, match="descriptor"):
        decode_offer(encode_offer(_offer(descriptor={"x": [1]})), gen=3, attempt=2, gpu="GPU-a")


def test_verdict_and_pattern() -> None:
    v = Verdict(False, ev.SHM_NOT_SHARED, "no", reader_pid=5, reader_host="h")
    assert Verdict.from_json(v.to_json()) == v
    with pytest.raises(OfferError):
        Verdict(True, ev.SHM_NOT_SHARED)
    with pytest.raises(OfferError):
        Verdict.from_json("{}")
    a, b = pattern(4096, 1), pattern(4096, 2)
    assert a.dtype == torch.uint8 and not torch.equal(a, b) and torch.equal(a, pattern(4096, 1))
    assert not torch.equal(a[:256], a[256:512])  # a shifted window does not match either


def test_events_carry_an_optional_reason() -> None:
    event = StepEvent(
        role="trainer", gen=1, step=0, phase="preflight", result="error", reason=ev.PEER_TIMEOUT
    )
    fields = ev.encode(event, now=1.0)
    assert fields["reason"] == ev.PEER_TIMEOUT and fields["v"] == "1"
    assert ev.decode(fields).reason == ev.PEER_TIMEOUT
    plain = ev.encode(StepEvent(role="trainer", gen=1, step=1, phase="finished", result="ok"), now=1.0)
    assert "reason" not in plain and ev.decode(plain).reason == ""  # entries of older writers decode
    with pytest.raises(ev.EventError):
        ev.decode({**fields, "reason": "Gremlins"})


def test_config_reads_the_preflight_variables(redis_server: RedisServer, tmp_path: Path) -> None:
    env = base_env(redis_server, tmp_path, "Wait", 30)
    cfg = ColocateConfig.from_env({**env, "COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS": "300"})
    assert (cfg.ipc_preflight, cfg.ipc_preflight_timeout_s, cfg.ipc_preflight_wait_s) == ("Wait", 30, 300)
    settings = PreflightSettings.from_config(cfg)
    assert (
        settings.mode == "Wait" and settings.shm_dir == str(tmp_path) and settings.prefix == "colocate-pf-job"
    )
    unset = {k: v for k, v in env.items() if not k.startswith("COLOCATE_IPC_PREFLIGHT")}
    assert ColocateConfig.from_env(unset).ipc_preflight == "Off"
    for key, value in (
        ("COLOCATE_IPC_PREFLIGHT", "Sometimes"),
        ("COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS", "0"),
        ("COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS", "9999"),  # longer than the keys live
    ):
        with pytest.raises(ConfigError, match="COLOCATE_"):
            ColocateConfig.from_env({**env, key: value})
