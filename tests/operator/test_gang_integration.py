"""Native gang scheduling on the real plane: a control plane of its own with the GenericWorkload gate on (the
real kube-scheduler runs its GangScheduling plugin), where a job's pods are bound all together or not at all
(the old path, gate off: test_gang_fallback_integration.py). The same plane has ContainerRestartRules off, as
a cluster without the feature: the apiserver drops the SGLang container's restart rules, and an exited SGLang
restarts the whole group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from colocate_devcluster import GANG_SCHEDULING, Cluster, ClusterSpec, manifests
from tests.kube import wait_for
from tests.operator.harness import OperatorProcess, install_crd
from tests.operator.test_integration import (
    apply_job,
    condition,
    get,
    job_status,
    patch_pod_status,
    pods,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration

GPU_NODES = 2  # the job below asks for 3 whole nodes: one short until the test adds a node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """This module's own plane, gates on (overrides the session's `cluster` for the tests here)."""
    spec = ClusterSpec(
        workdir=tmp_path_factory.mktemp("gang-devcluster"),
        gpu_nodes=GPU_NODES,
        gpus_per_node=8,
        extra_apiserver_args=("--enable-admission-plugins=OwnerReferencesPermissionEnforcement",),
        feature_gates=(
            *GANG_SCHEDULING["feature_gates"],
            "ContainerRestartRules=false",
            "RestartAllContainersOnContainerExits=false",  # it needs ContainerRestartRules
        ),
        runtime_config=GANG_SCHEDULING["runtime_config"],
    )
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> Path:
    return install_crd(cluster)


def bound(items: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in items if (p.get("spec") or {}).get("nodeName")]


def test_pods_bind_all_or_nothing_through_the_pod_group(
    cluster: Cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    served = cluster.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").stdout.split()
    assert {"workloads.scheduling.k8s.io", "podgroups.scheduling.k8s.io"} <= set(served)
    assert "native gang scheduling on" in operator_process.log()

    apply_job(cluster, namespace, numNodes=3, gpusPerNode=8)
    group = wait_for(
        lambda: _group_unschedulable(cluster, namespace), 60, "PodGroup demo-gang reported Unschedulable"
    )
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}
    assert group["spec"]["workloadRef"] == {"workloadName": "demo-gang", "templateName": "workers"}
    workload = get(cluster, namespace, "workloads.scheduling.k8s.io", "demo-gang")
    (template,) = workload["spec"]["podGroupTemplates"]
    assert (template["name"], template["schedulingPolicy"]) == ("workers", {"gang": {"minCount": 3}})
    assert workload["spec"]["controllerRef"] == {
        "apiGroup": "colocate.dev",
        "kind": "ColocateJob",
        "name": "demo",
    }
    for owned in (group, workload):
        assert owned["metadata"]["ownerReferences"][0]["name"] == "demo"
    items = pods(cluster, namespace)
    assert len(items) == 3
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "demo-gang"} for p in items)
    # GPUs for two of the three pods: without the gang two would bind now. None does, and none stays bound.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        items = pods(cluster, namespace)
        assert bound(items) == [], f"a pod bound before the whole gang fit: {bound(items)}"
        assert all(p["status"].get("phase") == "Pending" for p in items)
        time.sleep(1)
    assert job_status(cluster, namespace).get("replicas", {}).get("scheduled") == 0

    # Capacity for the third pod appears: the whole gang binds.
    node = manifests.gpu_node_name(GPU_NODES)
    cluster.apply(
        [n for n in manifests.fake_nodes(GPU_NODES + 1, 8) if n["metadata"]["name"] == node]
        + [manifests.resource_slice(node, 8)]
    )
    wait_for(lambda: len(bound(pods(cluster, namespace))) == 3, 90, "all 3 pods bound after the new node")
    nodes = {p["spec"]["nodeName"] for p in pods(cluster, namespace)}
    assert len(nodes) == 3
    wait_for(
        lambda: job_status(cluster, namespace).get("phase") == "Running", 60, "the job Running on all 3 pods"
    )


def _group_unschedulable(cluster: Cluster, namespace: str) -> dict[str, Any] | None:
    found = cluster.kubectl(
        "get", "podgroups.scheduling.k8s.io", "demo-gang", "-n", namespace, "-o", "json", check=False
    )
    if found.returncode != 0:
        return None
    group = json.loads(found.stdout)
    conditions = (group.get("status") or {}).get("conditions") or []
    unschedulable = any(
        (c["type"], c["status"], c["reason"]) == ("PodGroupInitiallyScheduled", "False", "Unschedulable")
        for c in conditions
    )
    return group if unschedulable else None


def test_without_container_restart_rules_an_exited_engine_restarts_the_group(
    cluster: Cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(
        cluster, namespace, numNodes=2, gpusPerNode=2, runPolicy={"maxRestarts": 2, "backoffSeconds": 0}
    )
    wait_phase(cluster, namespace, "Running", timeout=90)
    first = running_pods(cluster, namespace, 2, restart=0)
    rollout = next(c for c in first[0]["spec"]["containers"] if c["name"] == "rollout")
    assert "restartPolicyRules" not in rollout, "the apiserver without ContainerRestartRules drops them"
    # What a kubelet reports when SGLang exits and nothing restarts it: the container terminated, the pod
    # still Running (the trainer runs on, talking to no engine).
    statuses = [
        {
            "name": "trainer",
            "ready": True,
            "restartCount": 0,
            "image": "t",
            "imageID": "",
            "state": {"running": {}},
        },
        {
            "name": "rollout",
            "ready": False,
            "restartCount": 0,
            "image": "s",
            "imageID": "",
            "state": {"terminated": {"exitCode": 137, "reason": "Error"}},
        },
    ]
    patch_pod_status(
        cluster, namespace, first[0]["metadata"]["name"], {"status": {"containerStatuses": statuses}}
    )

    def restarted() -> dict[str, Any] | None:
        status = job_status(cluster, namespace)
        return status if condition(status, "Restarting").get("reason") == "EngineExited" else None

    status = wait_for(restarted, 60, "Restarting/EngineExited")
    assert status["restarts"] == 1
    assert "ContainerRestartRules" in condition(status, "Restarting")["message"]
    running_pods(cluster, namespace, 2, restart=1)
