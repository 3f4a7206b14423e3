"""Real Kueue (v0.17, built from its Go module, webhooks served over the local PKI) on the real plane, with
the operator under the chart's RBAC: a ColocateJob with a queue is a Workload of its own. With quota for one
job a second one waits, saying why in Kueue's words, and starts when the first is deleted (a third when the
second succeeds); the requests Kueue counts are the pods' own; a higher WorkloadPriorityClass preempts a
running job, whose pods go (its suspend path), which says why, and which runs again once the quota is free."""

from __future__ import annotations

import json
from typing import Any

import pytest

from colocate_runtime.contract.events import final_termination_message
from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.kueue_setup import FLAVOR_LABELS, GPU, GPUS, NODES, QUEUE, Quota
from tests.operator.test_integration import (
    condition,
    get,
    job_manifest,
    job_status,
    patch_pod_status,
    pods,
    wait_phase,
)

pytestmark = pytest.mark.integration


def submit(cluster, namespace: str, name: str, priority_class: str | None = None) -> None:
    manifest = job_manifest(
        name, namespace, numNodes=NODES, gpusPerNode=GPUS, gpu={"allocation": "DevicePlugin"}
    )
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE}
    if priority_class:
        manifest["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = priority_class
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def running(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        items = [p for p in pods(cluster, namespace, name) if not p["metadata"].get("deletionTimestamp")]
        ok = len(items) == NODES and all(p["status"].get("phase") == "Running" for p in items)
        return items if ok else None

    return wait_for(probe, 60, f"{NODES} Running pods of ColocateJob {namespace}/{name}")


def admitted(cluster, namespace: str, name: str, reason: str, timeout: float = 60) -> dict[str, Any]:
    return wait_for(
        lambda: (
            (c := condition(job_status(cluster, namespace, name), "Admitted")).get("reason") == reason and c
        ),
        timeout,
        f"Admitted={reason} on ColocateJob {namespace}/{name}",
    )


def requests(pod_spec: dict[str, Any]) -> list[dict[str, dict[str, str]]]:
    """Each container's requests and limits, quantities as strings (a Pod's come back as "8", a Workload's
    template keeps the 8 the operator wrote)."""
    return [
        {
            kind: {k: str(v) for k, v in values.items()}
            for kind, values in c["resources"].items()
            if kind != "claims"
        }
        for c in pod_spec["containers"]
    ]


def succeed(cluster, namespace: str, name: str) -> None:
    """What a kubelet reports when the training ends: both containers exited 0, the trainer's termination
    message holding the final record (kwok runs no containers)."""
    done = {"terminated": {"exitCode": 0, "reason": "Completed", "message": final_termination_message(3)}}
    for index in range(NODES):
        statuses = [
            {"name": c, "state": done, "ready": False, "restartCount": 0, "image": c, "imageID": ""}
            for c in ("trainer", "rollout")
        ]
        patch = {"status": {"phase": "Succeeded", "containerStatuses": statuses}}
        patch_pod_status(cluster, namespace, f"{name}-{index}", patch)


def workload(cluster, namespace: str, name: str) -> dict[str, Any]:
    return get(cluster, namespace, "workloads.kueue.x-k8s.io", name)


def test_quota_for_one_job_queues_the_second_until_the_first_is_deleted(
    cluster, namespace: str, quota: Quota, operator_process: OperatorProcess
) -> None:
    submit(cluster, namespace, "first")
    first = running(cluster, namespace, "first")
    assert (
        "ClusterQueue " + quota.cluster_queue
        in admitted(cluster, namespace, "first", "AdmittedByKueue")["message"]
    )

    # What Kueue counts is what the pods ask for: the pod set's template is the worker pod, and the usage it
    # admitted equals the sum of the running pods' requests.
    wl = workload(cluster, namespace, "first")
    assert wl["metadata"]["ownerReferences"][0]["name"] == "first"
    (podset,) = wl["spec"]["podSets"]
    assert podset["count"] == NODES
    for pod in first:
        assert requests(pod["spec"]) == requests(podset["template"]["spec"])
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"], (
            "Kueue's pod integration stays out"
        )
        assert pod["spec"]["nodeSelector"] == FLAVOR_LABELS, "on the admitted flavor's nodes"
    requested = sum(
        int(c["resources"].get("requests", {}).get(GPU, 0)) for p in first for c in p["spec"]["containers"]
    )
    (assignment,) = wl["status"]["admission"]["podSetAssignments"]
    assert (assignment["flavors"], int(assignment["resourceUsage"][GPU])) == ({GPU: quota.flavor}, requested)
    assert requested == NODES * GPUS

    submit(cluster, namespace, "second")
    waiting = admitted(cluster, namespace, "second", "QueuedByKueue")
    wait_for(
        lambda: "quota" in condition(job_status(cluster, namespace, "second"), "Admitted").get("message", ""),
        30,
        "Kueue's reason (insufficient quota) in the waiting job's Admitted condition",
    )
    status = job_status(cluster, namespace, "second")
    assert status["phase"] == "Pending" and pods(cluster, namespace, "second") == [], waiting
    assert condition(status, "PodsReady")["reason"] == "QueuedByKueue"

    cluster.kubectl("delete", "colocatejob", "first", "-n", namespace)
    running(cluster, namespace, "second")
    admitted(cluster, namespace, "second", "AdmittedByKueue")
    wait_phase(cluster, namespace, "Running", name="second")

    # A job that succeeds gives its quota back too: its Workload is marked Finished, the next one starts.
    submit(cluster, namespace, "third")
    admitted(cluster, namespace, "third", "QueuedByKueue")
    succeed(cluster, namespace, "second")
    wait_phase(cluster, namespace, "Succeeded", name="second")
    finished = condition(workload(cluster, namespace, "second")["status"], "Finished")
    assert (finished.get("status"), finished.get("reason")) == ("True", "Succeeded"), finished
    running(cluster, namespace, "third")
    admitted(cluster, namespace, "third", "AdmittedByKueue")


def test_a_higher_priority_job_preempts_a_running_one_which_requeues(
    cluster, namespace: str, quota: Quota, operator_process: OperatorProcess
) -> None:
    for klass, value in ((f"low-{namespace}", 100), (f"high-{namespace}", 1000)):
        quota.priority_classes.append(klass)
        cluster.apply(
            [
                {
                    "apiVersion": "kueue.x-k8s.io/v1beta2",
                    "kind": "WorkloadPriorityClass",
                    "metadata": {"name": klass},
                    "value": value,
                }
            ]
        )
    submit(cluster, namespace, "low", f"low-{namespace}")
    running(cluster, namespace, "low")
    wait_phase(cluster, namespace, "Running", name="low")
    assert workload(cluster, namespace, "low")["spec"]["priority"] == 100

    submit(cluster, namespace, "high", f"high-{namespace}")
    # The preempted job goes through its suspend path: pods deleted, Suspended says Kueue evicted it.
    suspended = wait_phase(cluster, namespace, "Suspended", name="low")
    assert condition(suspended, "Suspended")["reason"] == "EvictedByKueue"
    wait_for(lambda: pods(cluster, namespace, "low") == [], 60, "the preempted job's pods gone")
    events = get(cluster, namespace, "events")["items"]
    assert any(e["involvedObject"]["name"] == "low" and e["reason"] == "EvictedByKueue" for e in events)
    running(cluster, namespace, "high")
    assert workload(cluster, namespace, "high")["spec"]["priority"] == 1000
    # Its Workload was handed back (quota released) and waits again: Kueue's Requeued after a preemption.
    low = workload(cluster, namespace, "low")
    conds = {c["type"]: c for c in low["status"]["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and "admission" not in low["status"]
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    why = condition(job_status(cluster, namespace, "low"), "Admitted")
    assert why["status"] == "False" and "Preempted" in why["message"], why

    cluster.kubectl("delete", "colocatejob", "high", "-n", namespace)
    running(cluster, namespace, "low")
    admitted(cluster, namespace, "low", "AdmittedByKueue")
    wait_phase(cluster, namespace, "Running", name="low")


def test_a_deactivated_workload_suspends_the_job_until_it_is_active_again(
    cluster, namespace: str, quota: Quota, operator_process: OperatorProcess
) -> None:
    """Kueue's way to take a job off its quota by hand (spec.active=false on the Workload) is an eviction
    like any other: the job suspends and hands the quota back, and runs again once reactivated."""
    submit(cluster, namespace, "paused")
    running(cluster, namespace, "paused")

    def activate(active: bool) -> None:
        patch = json.dumps({"spec": {"active": active}})
        cluster.kubectl(
            "patch", "workloads.kueue.x-k8s.io", "paused", "-n", namespace, "--type=merge", "-p", patch
        )

    activate(False)
    suspended = wait_phase(cluster, namespace, "Suspended", name="paused")
    assert condition(suspended, "Suspended")["reason"] == "EvictedByKueue"
    wait_for(lambda: pods(cluster, namespace, "paused") == [], 60, "the deactivated job's pods gone")
    wait_for(
        lambda: "admission" not in (workload(cluster, namespace, "paused").get("status") or {}),
        30,
        "the deactivated Workload's admission cleared (quota handed back)",
    )
    activate(True)
    running(cluster, namespace, "paused")
    admitted(cluster, namespace, "paused", "AdmittedByKueue")
