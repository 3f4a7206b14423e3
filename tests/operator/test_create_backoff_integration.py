"""Issue 30 item 6 on the real control plane: pods a ResourceQuota refuses are created again with an
exponential backoff (5 s, 10 s, 20 s, ...), not on every pass (the tests' resync runs a pass every 2 s),
PodsReady carries the API server's refusal, and lifting the quota lets the job run."""

from __future__ import annotations

import json
import time

import pytest

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, condition, job_status, wait_phase

pytestmark = pytest.mark.integration

# The worker pods request nvidia.com/gpu (DevicePlugin); the Redis meta-store pod requests none.
QUOTA = {
    "apiVersion": "v1",
    "kind": "ResourceQuota",
    "metadata": {"name": "no-gpus"},
    "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
}
WINDOW = (
    12.0  # seconds after the first refusal: tries at 0 and 5 s (the next at 15); every 2 s before the fix
)


def refused_creates(process: OperatorProcess, pod: str) -> int:
    """How often the operator's log says a create of `pod` failed."""
    count = 0
    for line in process.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        count += str(record.get("message", "")).startswith("create failed") and record.get("child") == pod
    return count


def test_refused_pods_back_off_carry_the_quota_message_and_run_once_it_is_lifted(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(QUOTA))
    wait_for(
        lambda: cluster.kubectl("get", "resourcequota", "no-gpus", "-n", namespace, "-o", "json").stdout,
        10,
        "the quota",
    )
    apply_job(cluster, namespace, gpu={"allocation": "DevicePlugin"}, gpusPerNode=1)

    def refused() -> dict | None:
        status = job_status(cluster, namespace)
        return status if condition(status, "PodsReady").get("reason") == "CreateRefused" else None

    status = wait_for(refused, 30, "PodsReady=False/CreateRefused")
    first = time.monotonic()
    message = condition(status, "PodsReady")["message"]
    assert "exceeded quota: no-gpus" in message and "demo-0" in message, message

    time.sleep(max(0.0, first + WINDOW - time.monotonic()))
    tries = refused_creates(operator_process, "demo-0")
    assert tries == 2, f"{tries} creates of demo-0 in {WINDOW:.0f} s (backoff 5 s, then 10 s: 2)"
    message = condition(job_status(cluster, namespace), "PodsReady")["message"]
    assert "2 times in a row" in message and "exceeded quota" in message, message

    cluster.kubectl("delete", "resourcequota", "no-gpus", "-n", namespace)
    status = wait_phase(cluster, namespace, "Running", timeout=30)  # at the third attempt, 15 s in
    assert condition(status, "PodsReady")["reason"] == "AllPodsReady"
    assert refused_creates(operator_process, "demo-0") == 2
