"""A node drain against a running gang on the real plane: the job's PodDisruptionBudget refuses the eviction
(HTTP 429, as `kubectl drain` sees it) while every pod is healthy; a forced drain (pods deleted, not evicted)
bypasses any budget, and the operator then restarts the whole group on the remaining nodes, spending one
restart of runPolicy.maxRestarts. A rank that runs but is not ready may be evicted (and restarts the group).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    condition,
    get,
    job_event_reasons,
    job_status,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration

SELECTOR = "colocate.dev/job=demo,colocate.dev/component=worker"
# /dev/shm and the socket directory are emptyDirs, which kubectl drain keeps pods for unless told otherwise;
# the pods have a controller (the job), so no --force is needed.
DRAIN = ("--ignore-daemonsets", "--delete-emptydir-data", f"--pod-selector={SELECTOR}")


@pytest.fixture
def core(cluster) -> k8s_client.CoreV1Api:
    return k8s_client.CoreV1Api(k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig)))


@pytest.fixture
def drained(cluster) -> Iterator[list[str]]:
    """Nodes a test cordons are made schedulable again afterwards: the cluster is shared by the session."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        cluster.kubectl("uncordon", node, check=False)


def evict(core: k8s_client.CoreV1Api, namespace: str, pod: str) -> ApiException | None:
    """What `kubectl drain` does for each pod: a policy/v1 Eviction. The refusal, or None if evicted."""
    body = k8s_client.V1Eviction(metadata=k8s_client.V1ObjectMeta(name=pod, namespace=namespace))
    try:
        core.create_namespaced_pod_eviction(pod, namespace, body)
    except ApiException as e:
        return e
    return None


def budget_holds(cluster, namespace: str, pods: int) -> dict[str, Any]:
    """The disruption controller has counted the current group: all healthy, no disruption allowed."""

    def probe() -> dict[str, Any] | None:
        pdb = get(cluster, namespace, "pdb", "demo-workers")
        status = pdb.get("status") or {}
        synced = status.get("observedGeneration") == pdb["metadata"]["generation"]
        counted = (status.get("currentHealthy"), status.get("desiredHealthy"), status.get("expectedPods"))
        ok = synced and counted == (pods, pods, pods) and status.get("disruptionsAllowed") == 0
        return status if ok else None

    return wait_for(probe, 30, f"PodDisruptionBudget demo-workers counting {pods}/{pods} healthy pods")


def test_a_drain_is_refused_by_the_budget_and_a_forced_drain_restarts_the_group(
    cluster, namespace: str, operator_process: OperatorProcess, core: k8s_client.CoreV1Api, drained: list[str]
) -> None:
    apply_job(cluster, namespace, gpusPerNode=4, runPolicy={"maxRestarts": 2, "backoffSeconds": 0})
    wait_phase(cluster, namespace, "Running")
    first = running_pods(cluster, namespace, 2, 0)
    pdb = get(cluster, namespace, "pdb", "demo-workers")
    uid = get(cluster, namespace, "colocatejob", "demo")["metadata"]["uid"]
    assert [r["uid"] for r in pdb["metadata"]["ownerReferences"]] == [uid]
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == {
        "colocate.dev/job": "demo",
        "colocate.dev/component": "worker",
    }
    budget_holds(cluster, namespace, 2)

    # The eviction API refuses each pod of the gang while the budget holds.
    for pod in first:
        refused = evict(core, namespace, pod["metadata"]["name"])
        assert refused is not None, f"{pod['metadata']['name']} was evicted"
        assert refused.status == 429, (refused.status, refused.body)
        assert "disruption budget" in refused.body, refused.body

    # `kubectl drain` itself: it cordons the node, retries the eviction and gives up at its timeout.
    victim = first[0]
    node = victim["spec"]["nodeName"]
    drained.append(node)
    result = cluster.kubectl("drain", node, *DRAIN, "--timeout=12s", check=False)
    assert result.returncode != 0, result.stdout
    assert "disruption budget" in result.stderr, result.stderr
    assert get(cluster, "default", "node", node)["spec"].get("unschedulable") is True, "drain cordons"
    still = running_pods(cluster, namespace, 2, 0)
    assert [p["metadata"]["uid"] for p in still] == [p["metadata"]["uid"] for p in first]
    status = job_status(cluster, namespace)
    assert status["restarts"] == 0 and status["phase"] == "Running"

    # A forced drain deletes instead of evicting: no budget is consulted. The operator sees a deleted pod of
    # the group and restarts the whole group (the surviving pod too), placing it off the cordoned node.
    result = cluster.kubectl("drain", node, *DRAIN, "--disable-eviction", "--timeout=60s", check=False)
    assert result.returncode == 0, result.stderr
    second = running_pods(cluster, namespace, 2, 1)
    assert {p["metadata"]["uid"] for p in second}.isdisjoint(p["metadata"]["uid"] for p in first)
    assert node not in {p["spec"]["nodeName"] for p in second}
    status = wait_phase(cluster, namespace, "Running")
    assert status["restarts"] == 1, "a forced drain costs one group restart"
    restarting = condition(status, "Restarting")
    assert restarting["status"] == "False"
    assert "RestartingGroup" in job_event_reasons(cluster, namespace)
    events = get(cluster, namespace, "events")["items"]
    restart_messages = [e["message"] for e in events if e["reason"] == "RestartingGroup"]
    # Seen while it terminated ("was deleted") or once gone ("disappeared"): kwok ends pods at once.
    gone = (f"pod {victim['metadata']['name']} was deleted", f"pod {victim['metadata']['name']} disappeared")
    assert any(m.startswith(gone) for m in restart_messages), restart_messages

    # The same budget (never recreated) covers the new group.
    assert get(cluster, namespace, "pdb", "demo-workers")["metadata"]["uid"] == pdb["metadata"]["uid"]
    budget_holds(cluster, namespace, 2)
    refused = evict(core, namespace, second[0]["metadata"]["name"])
    assert refused is not None and refused.status == 429, refused

    # A rank that runs but is not ready (that gang is broken anyway) may be evicted, so a stuck job never
    # blocks a drain for good (unhealthyPodEvictionPolicy: AlwaysAllow); its healthy peer is still refused.
    unready, healthy = (p["metadata"]["name"] for p in second)
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "SGLangStuck"}]}}
    cluster.kubectl(
        "patch", "pod", unready, "-n", namespace, "--subresource=status", "-p", json.dumps(not_ready)
    )
    wait_for(
        lambda: (
            (get(cluster, namespace, "pdb", "demo-workers").get("status") or {}).get("currentHealthy") == 1
        ),
        30,
        "PodDisruptionBudget demo-workers counting 1 healthy pod",
    )
    refused = evict(core, namespace, healthy)
    assert refused is not None and refused.status == 429, refused
    assert evict(core, namespace, unready) is None, f"the not-ready pod {unready} was not evicted"
    running_pods(cluster, namespace, 2, 2)
    assert job_status(cluster, namespace)["restarts"] == 2
