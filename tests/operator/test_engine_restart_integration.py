"""SGLang restarted in place on the real plane: the stored pods keep the rollout container's restart rules
(the apiserver serves ContainerRestartRules, on by default), and a container restart the kubelet would
report (kwok runs no containers: the pod's status is patched) shows in status.engineRestarts and on
EngineRecovered, while the job stays Running and spends none of its group restarts."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    condition,
    job_event_reasons,
    job_status,
    patch_pod_status,
    running_pods,
    wait_condition,
    wait_phase,
)
from tests.operator.test_integration import (
    pods as worker_pods,
)

pytestmark = pytest.mark.integration


def containers(engine_restarts: int, engine_ready: bool) -> dict[str, Any]:
    """What a kubelet reports after SGLang was killed (137) and restarted in place `engine_restarts` times."""
    rollout: dict[str, Any] = {
        "name": "rollout",
        "ready": engine_ready,
        "restartCount": engine_restarts,
        "image": "s",
        "imageID": "",
        "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}},
    }
    trainer = {
        "name": "trainer",
        "ready": True,
        "restartCount": 0,
        "image": "t",
        "imageID": "",
        "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}},
    }
    return {"status": {"containerStatuses": [trainer, rollout]}}


def test_an_engine_restart_in_place_is_counted_and_the_group_keeps_running(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, gpusPerNode=2, runPolicy={"maxRestarts": 1})
    wait_phase(cluster, namespace, "Running")
    pods = running_pods(cluster, namespace, 2, restart=0)
    rollout = next(c for c in pods[0]["spec"]["containers"] if c["name"] == "rollout")
    assert rollout["restartPolicy"] == "Never"
    assert rollout["restartPolicyRules"] == [
        {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0]}}
    ]
    uids = sorted(p["metadata"]["uid"] for p in pods)

    patch_pod_status(cluster, namespace, "demo-0", containers(1, engine_ready=False))

    def restarting() -> dict[str, Any] | None:
        status = job_status(cluster, namespace)
        c = condition(status, "EngineRecovered")
        return status if status.get("engineRestarts") == 1 and c.get("reason") == "EngineRestarting" else None

    status = wait_for(restarting, 30, "engineRestarts 1 and EngineRecovered=False/EngineRestarting")
    assert status["phase"] == "Running" and status["restarts"] == 0

    patch_pod_status(cluster, namespace, "demo-0", containers(1, engine_ready=True))
    status = wait_condition(cluster, namespace, "EngineRecovered", "True")
    assert status["engineRestarts"] == 1 and status["restarts"] == 0 and status["phase"] == "Running"
    assert "EngineRestarted" in job_event_reasons(cluster, namespace)
    assert "RestartingGroup" not in job_event_reasons(cluster, namespace)
    now = sorted(p["metadata"]["uid"] for p in worker_pods(cluster, namespace))
    assert now == uids, "the pods were not replaced"
