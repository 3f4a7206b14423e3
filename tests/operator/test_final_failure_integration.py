"""A failed training ends Failed (issue 30, item 3), on the real control plane with a real Redis: the
trainer's last record says the run failed (`finish(ok=False)` in runtime/colocated/writer.py: phase
`final`, result `error`, its message), the pods exit, and the job ends Failed with that message, never
Succeeded and never restarted. kwok runs no containers: the test writes the record as the writer does and
reports the pods' exits as a kubelet would."""

from __future__ import annotations

import time
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    condition,
    fail_pod,
    job_event_reasons,
    job_status,
    patch_pod_status,
    pods,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration

MESSAGE = "loss is NaN at step 7"


def test_a_final_record_with_an_error_result_ends_the_job_failed_with_the_trainers_message(
    cluster: Any, namespace: str, operator_process: OperatorProcess, redis_server: RedisServer
) -> None:
    metastore_secret(cluster, namespace, redis_server)
    apply_job(cluster, namespace, gpusPerNode=1, metaStore=external_metastore(redis_server))
    wait_phase(cluster, namespace, "Running")
    running_pods(cluster, namespace, 2, 0)
    client = redis_server.client()
    for gpu in ("GPU-a", "GPU-b"):  # both ranks call finish(ok=False) with the exception's text
        final = StepEvent(
            role="trainer", gen=1, step=7, phase="final", gpu=gpu, result="error", final=True, error=MESSAGE
        )
        xadd(client, stream_key(namespace, "demo"), final)
    wait_for(
        lambda: job_status(cluster, namespace).get("weightSync", {}).get("finalStepRecorded"),
        30,
        "the final record in status",
    )
    # The trainers exit 1 after their failed final record; the pods end Failed, as a kubelet reports.
    fail_pod(cluster, namespace, "demo-0")
    patch_pod_status(cluster, namespace, "demo-1", {"status": {"phase": "Failed", "reason": "Error"}})
    started = time.monotonic()
    status = wait_for(
        lambda: (s := job_status(cluster, namespace)).get("phase") in ("Succeeded", "Failed") and s,
        30,
        "a terminal phase",
    )
    print(f"\nterminal phase {status['phase']} {time.monotonic() - started:.1f} s after the pods exited")
    assert status["phase"] == "Failed", (
        f"a failed training ended {status['phase']}: {status.get('conditions')}"
    )
    failed = condition(status, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "TrainingFailed"
    assert MESSAGE in failed["message"], failed
    assert condition(status, "Succeeded").get("status") != "True"
    assert status["weightSync"]["finalResult"] == "Failed" and MESSAGE in status["weightSync"]["finalMessage"]
    assert status["restarts"] == 0 and "RestartingGroup" not in job_event_reasons(cluster, namespace)
    reasons = job_event_reasons(cluster, namespace)
    assert "JobFailed" in reasons and "JobSucceeded" not in reasons
    assert len(pods(cluster, namespace)) == 2, "finished pods are kept for their logs"
