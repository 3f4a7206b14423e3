"""Control-plane components that exit on their own are started again, as a kubelet restarts a static pod
(devcluster/supervise.py); one stopped on purpose stays stopped. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.processes import Component
from colocate_devcluster.supervise import MAX_BACKOFF, Supervisor, next_delay
from tests.kube import get_json, wait_for


def test_backoff_is_the_kubelets_crash_loop_backoff() -> None:
    assert [next_delay(n) for n in range(7)] == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, MAX_BACKOFF]
    assert next_delay(30) == MAX_BACKOFF


def _sleeper(tmp_path: Path, name: str) -> Component:
    component = Component(name, ["/bin/sleep", "300"], tmp_path / f"{name}.log")
    component.start()
    return component


def test_an_exited_component_is_restarted_and_a_stopped_one_is_not(tmp_path: Path) -> None:
    crashing, stopped = _sleeper(tmp_path, "crashing"), _sleeper(tmp_path, "stopped")
    said: list[str] = []
    supervisor = Supervisor([crashing, stopped], threading.Lock(), said.append).start()
    try:
        first = crashing.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: crashing.pid != first and crashing.alive(), 10, "the killed component started again")
        assert supervisor.restarts == {"crashing": 1, "stopped": 0}
        assert any("crashing exited with code -9" in line for line in said), said
        stopped.stop()
        time.sleep(1.5)  # three polls
        assert not stopped.alive() and supervisor.restarts["stopped"] == 0
    finally:
        supervisor.stop()
        crashing.stop()
        stopped.stop()


@pytest.mark.integration
def test_killed_scheduler_is_restarted_and_schedules_again(cluster: Cluster, namespace: str) -> None:
    """kube-scheduler exits on purpose when it finds its cache corrupted; a kubelet would start it again."""
    scheduler = next(c for c in cluster.components if c.name == "kube-scheduler")
    assert cluster.supervisor is not None and scheduler.pid is not None
    before = cluster.supervisor.restarts["kube-scheduler"]
    os.killpg(scheduler.pid, signal.SIGKILL)
    wait_for(lambda: cluster.supervisor.restarts["kube-scheduler"] > before, 15, "the scheduler restarted")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "after"}}
    pod["spec"] = {"containers": [{"name": "main", "image": "busybox"}]}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    wait_for(
        lambda: get_json(cluster, "pod", "after", "-n", namespace)["spec"].get("nodeName"),
        90,
        "a pod created after the restart scheduled",
    )
    state = json.loads((cluster.workdir / "state.json").read_text())
    assert {c["name"]: c["pid"] for c in state["components"]}["kube-scheduler"] == scheduler.pid
