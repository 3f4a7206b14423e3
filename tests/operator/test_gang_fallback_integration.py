"""Where the cluster does not serve the Workload/PodGroup API (the session's plane: GenericWorkload off, as
in Kubernetes 1.37 by default), the operator keeps the old path: no Workload or PodGroup, no scheduling group
on the pods, which the scheduler places one by one."""

from __future__ import annotations

import pytest

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, pods

pytestmark = pytest.mark.integration


def test_without_the_workload_api_pods_are_placed_one_by_one(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    served = cluster.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").stdout.split()
    assert "workloads.scheduling.k8s.io" not in served and "podgroups.scheduling.k8s.io" not in served
    assert "native gang scheduling off" in operator_process.log()

    # Five pods, one per node, on four GPU nodes: the old path binds those that fit and leaves one Pending.
    apply_job(cluster, namespace, numNodes=5, gpusPerNode=2)

    def split() -> tuple[list[str], list[str]] | None:
        items = pods(cluster, namespace)
        placed = [p["metadata"]["name"] for p in items if p["spec"].get("nodeName")]
        waiting = [
            p["metadata"]["name"]
            for p in items
            if not p["spec"].get("nodeName")
            and any(
                c["type"] == "PodScheduled" and c["status"] == "False"
                for c in p["status"].get("conditions") or []
            )
        ]
        return (placed, waiting) if len(items) == 5 and placed and waiting else None

    placed, waiting = wait_for(split, 60, "some pods bound while another is unschedulable")
    assert placed and waiting
    for pod in pods(cluster, namespace):
        assert "schedulingGroup" not in pod["spec"]
    for kind in ("workloads.scheduling.k8s.io", "podgroups.scheduling.k8s.io"):
        assert cluster.kubectl("get", kind, "-n", namespace, check=False).returncode != 0
