"""Issue 30 item 7 on the real control plane: an SGLang container that keeps crashing (the kubelet's
restartCount of the rollout container, as a kubelet reports it: kwok runs no containers, so the pod status
is patched) restarts the group once runPolicy.maxEngineRestarts is used, and with the group restarts used
the job ends Failed, MaxRestartsExceeded, naming the crash loop; before the fix it stayed Running."""

from __future__ import annotations

import pytest

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_engine_restart_integration import containers
from tests.operator.test_integration import (
    apply_job,
    condition,
    get,
    job_event_reasons,
    job_status,
    patch_pod_status,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration


def test_a_crash_looping_engine_restarts_the_group_then_fails_the_job(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, gpusPerNode=2, runPolicy={"maxRestarts": 1, "maxEngineRestarts": 2})
    wait_phase(cluster, namespace, "Running")
    running_pods(cluster, namespace, 2, restart=0)

    patch_pod_status(cluster, namespace, "demo-0", containers(3, engine_ready=False))

    def restarted() -> dict | None:
        status = job_status(cluster, namespace)
        return status if status.get("restarts") == 1 else None

    status = wait_for(restarted, 30, "a group restart after SGLang's third restart in place")
    restarting = condition(status, "Restarting")
    assert restarting["reason"] == "EngineCrashLooping", restarting
    assert "spec.runPolicy.maxEngineRestarts=2" in restarting["message"], restarting
    wait_phase(cluster, namespace, "Running", timeout=60)  # backoff 10 s, then the new group
    running_pods(cluster, namespace, 2, restart=1)

    patch_pod_status(cluster, namespace, "demo-1", containers(3, engine_ready=False))
    status = wait_phase(cluster, namespace, "Failed", timeout=30)
    failed = condition(status, "Failed")
    assert failed["reason"] == "MaxRestartsExceeded", failed
    assert "SGLang restarted in place 3 times in this group" in failed["message"], failed
    assert "all 1 restarts used" in failed["message"], failed
    assert {"RestartingGroup", "JobFailed"} <= job_event_reasons(cluster, namespace)


def test_the_engine_restart_budget_defaults_to_five(cluster, namespace: str, crd) -> None:
    apply_job(cluster, namespace)
    stored = get(cluster, namespace, "colocatejob", "demo")
    assert stored["spec"]["runPolicy"]["maxEngineRestarts"] == 5
