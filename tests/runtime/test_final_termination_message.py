"""The trainer's final record also lands in its container's termination message (Kubernetes keeps it in the
pod's status), so the operator can tell a finished training from an early exit when the stream lost it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from colocate_devcluster.localredis import RedisServer
from colocate_operator.observed import PodState
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import connect, exporter_for
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.contract.events import (
    TERMINATION_LOG,
    final_termination_message,
    is_final_termination_message,
)


def writer_with_log(redis_server: RedisServer, tmp_path: Path, log: Path) -> WeightWriter:
    env = {
        "COLOCATE_JOB_NAME": "rl-job",
        "COLOCATE_NAMESPACE": "team-a",
        **redis_server.env(),
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(tmp_path / "shm"),
    }
    cfg = ColocateConfig.from_env(env)
    settings = WriterSettings.from_config(cfg)
    assert settings.termination_log == TERMINATION_LOG  # what runs in a pod
    writer = WeightWriter(
        connect(cfg), exporter_for(cfg), dataclasses.replace(settings, termination_log=str(log))
    )
    writer.start()
    return writer


def test_finish_leaves_the_final_record_as_the_termination_message(
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    log = tmp_path / "termination-log"
    log.touch()  # Kubernetes creates it in every container
    writer = writer_with_log(redis_server, tmp_path, log)
    try:
        writer.finish(ok=True)
    finally:
        writer.close()
    message = log.read_text()
    assert is_final_termination_message(message)
    # As the kubelet reports it: the operator's pod state sees the final record in the trainer container only.
    terminated = {"terminated": {"exitCode": 0, "reason": "Completed", "message": message}}
    body = {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "rollout", "state": terminated},
                {"name": "trainer", "state": terminated},
            ],
        },
    }
    assert PodState.from_body(body, "uid").final_message
    body["status"]["containerStatuses"] = [{"name": "rollout", "state": terminated}]
    assert not PodState.from_body(body, "uid").final_message


def test_a_failed_finish_or_a_machine_without_the_file_leaves_nothing(
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    absent = tmp_path / "no-such-log"
    writer = writer_with_log(redis_server, tmp_path, absent)
    try:
        writer.finish(ok=True)
    finally:
        writer.close()
    assert not absent.exists(), "never created outside Kubernetes"
    present = tmp_path / "termination-log"
    present.touch()
    writer = writer_with_log(redis_server, tmp_path, present)
    try:
        writer.finish(ok=False, error="diverged")
    finally:
        writer.close()
    assert present.read_text() == ""


def test_only_the_exact_record_counts() -> None:
    assert is_final_termination_message(final_termination_message(7))
    for text in (None, "", "colocateFinal", '{"colocateFinal": "error"}', "[1]", "x" * 5000, "{bad json"):
        assert not is_final_termination_message(text), text
