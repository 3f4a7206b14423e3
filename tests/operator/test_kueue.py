"""A ColocateJob as a Kueue workload of its own, without a cluster: the Workload it asks for, what it reads
from Kueue's answer, the gate in decide and the status changes it owes Kueue (the real Kueue is in
test_kueue_integration.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from colocate_operator import conditions, kueue, metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import KUEUE_QUEUE_LABEL, Cond, Phase, Reason
from colocate_operator.decide import decide
from colocate_operator.observed import Observed
from colocate_operator.spec import ColocateJob
from tests.operator import factories
from tests.operator.test_decide import INFRA, pod, running_observed, running_status

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
CONFIG = OperatorConfig()


def queued_job(queue: str = "team-a", *, priority_class: str | None = None, **override: Any) -> ColocateJob:
    body = factories.body(**{"gpu": {"allocation": "DevicePlugin"}, **override})
    body["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: queue}
    if priority_class:
        body["metadata"]["labels"][kueue.PRIORITY_CLASS_LABEL] = priority_class
    return ColocateJob.from_body(body)


def workload_body(job: ColocateJob, *conds: tuple[str, str, str, str], admission: bool = False) -> dict:
    body = kueue.workload(job, pods.pod(job, 0, 0, metastore.endpoint(job, CONFIG), CONFIG), None)
    body["metadata"] |= {"uid": "wl-uid", "resourceVersion": "42", "generation": 1}
    body["status"] = {
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": "2026-12-01T11:00:00Z"}
            for t, s, r, m in conds
        ]
    }
    if admission:
        body["status"]["admission"] = {"clusterQueue": "gpus", "podSetAssignments": []}
    return body


ADMITTED = (
    ("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
    ("Admitted", "True", "Admitted", "The workload is admitted"),
)
PREEMPTED = (
    *ADMITTED,
    ("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization"),
)
PENDING = (
    ("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set workers: insufficient quota"),
)


def state(
    job: ColocateJob, *conds: tuple[str, str, str, str], admission: bool = False
) -> kueue.WorkloadState:
    return kueue.WorkloadState.from_body(workload_body(job, *conds, admission=admission), job.ref.uid)


def test_workload_has_one_pod_set_whose_template_is_the_worker_pod() -> None:
    job = queued_job(priority_class="high", scheduling={"topology": {"required": "rack"}})
    worker = pods.pod(job, 0, 0, metastore.endpoint(job, CONFIG), CONFIG)
    body = kueue.workload(job, worker, 1000)
    assert body["apiVersion"] == "kueue.x-k8s.io/v1beta2" and body["kind"] == "Workload"
    assert body["metadata"]["ownerReferences"][0]["uid"] == job.ref.uid
    assert body["spec"]["queueName"] == "team-a"
    assert body["spec"]["priority"] == 1000
    assert body["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }
    (podset,) = body["spec"]["podSets"]
    assert (podset["name"], podset["count"]) == ("workers", job.spec.num_nodes)
    assert podset["topologyRequest"] == {"required": "rack"}
    template = podset["template"]["spec"]
    assert [c["resources"] for c in template["containers"]] == [
        c["resources"] for c in worker["spec"]["containers"]
    ]
    assert template["tolerations"] == worker["spec"]["tolerations"] and "hostname" not in template


def test_queue_label_wins_over_the_spec_field_and_no_queue_means_no_workload() -> None:
    body = factories.body(scheduling={"queueName": "from-spec"})
    assert kueue.queue_name(ColocateJob.from_body(body)) == "from-spec"
    body["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: "from-label"}
    assert kueue.queue_name(ColocateJob.from_body(body)) == "from-label"
    plan = decide(factories.job(), {}, Observed(device_class_found=True), NOW, CONFIG, "pw")
    assert "Workload" not in [m["kind"] for m in plan.creates]
    assert conditions.find(plan.status["conditions"], Cond.ADMITTED) is None


def test_a_queued_job_creates_its_workload_and_no_pods_until_admitted() -> None:
    job = queued_job()
    first = decide(job, {}, Observed(), NOW, CONFIG, "pw")
    kinds = [m["kind"] for m in first.creates]
    assert "Workload" in kinds and "Pod" not in kinds
    assert conditions.find(first.status["conditions"], Cond.ADMITTED)["reason"] == Reason.QUEUED_BY_KUEUE
    waiting = Observed(children=INFRA, metastore_ready=True, workload=state(job, *PENDING))
    second = decide(job, first.status, waiting, NOW, CONFIG, "pw")
    assert second.creates == () and second.status["phase"] == Phase.PENDING
    admitted = conditions.find(second.status["conditions"], Cond.ADMITTED)
    assert admitted["status"] == "False" and "insufficient quota" in admitted["message"]
    ready = conditions.find(second.status["conditions"], Cond.PODS_READY)
    assert ready["reason"] == Reason.QUEUED_BY_KUEUE
    go = Observed(children=INFRA, metastore_ready=True, workload=state(job, *ADMITTED, admission=True))
    third = decide(job, second.status, go, NOW, CONFIG, "pw")
    assert [m["kind"] for m in third.creates] == ["Pod", "Pod"]
    admitted = conditions.find(third.status["conditions"], Cond.ADMITTED)
    assert (admitted["status"], admitted["reason"]) == ("True", Reason.ADMITTED_BY_KUEUE)
    assert "ClusterQueue gpus" in admitted["message"]


def test_eviction_takes_the_suspend_path_and_then_hands_the_quota_back() -> None:
    job = queued_job()
    evicted = state(job, *PREEMPTED, admission=True)
    running = Observed(pods=running_observed().pods, children=INFRA, metastore_ready=True, workload=evicted)
    plan = decide(job, running_status(), running, NOW, CONFIG, "pw")
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1"}
    assert plan.status["phase"] == Phase.SUSPENDED
    suspended = conditions.find(plan.status["conditions"], Cond.SUSPENDED)
    assert (suspended["status"], suspended["reason"]) == ("True", Reason.EVICTED_BY_KUEUE)
    admitted = conditions.find(plan.status["conditions"], Cond.ADMITTED)
    assert admitted["reason"] == Reason.EVICTED_BY_KUEUE and "Preempted" in admitted["message"]
    # Pods still there: the admission is not cleared yet.
    assert kueue.clear_admission(evicted, NOW) is not None  # (the reconciler only asks once they are gone)
    gone = Observed(children=INFRA, metastore_ready=True, workload=evicted)
    settled = decide(job, plan.status, gone, NOW, CONFIG, "pw")
    assert settled.creates == () and settled.status["phase"] == Phase.SUSPENDED
    patch = kueue.clear_admission(evicted, NOW)
    assert patch is not None and patch["status"]["admission"] is None
    assert patch["metadata"]["resourceVersion"] == "42"
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True", "Kueue clears Evicted itself when it admits again"


def test_readmitted_after_eviction_resumes() -> None:
    job = queued_job()
    evicted = decide(
        job,
        running_status(),
        Observed(
            pods=running_observed().pods,
            children=INFRA,
            metastore_ready=True,
            workload=state(job, *PREEMPTED),
        ),
        NOW,
        CONFIG,
        "pw",
    )
    requeued = Observed(children=INFRA, metastore_ready=True, workload=state(job, *PENDING))
    waiting = decide(job, evicted.status, requeued, NOW, CONFIG, "pw")
    assert waiting.creates == () and waiting.status["phase"] == Phase.SUSPENDED
    again = Observed(children=INFRA, metastore_ready=True, workload=state(job, *ADMITTED, admission=True))
    resumed = decide(job, waiting.status, again, NOW, CONFIG, "pw")
    assert [m["kind"] for m in resumed.creates] == ["Pod", "Pod"]
    assert Reason.RESUMED in [e.reason for e in resumed.events]


@pytest.mark.parametrize(("phase", "reason"), [(Phase.SUCCEEDED, "Succeeded"), (Phase.FAILED, "Failed")])
def test_a_finished_job_finishes_its_workload(phase: str, reason: str) -> None:
    job = queued_job()
    admitted = state(job, *ADMITTED, admission=True)
    patch = kueue.finish(admitted, phase == Phase.SUCCEEDED, "done", NOW)
    assert patch is not None
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", reason)
    done = state(job, *ADMITTED, ("Finished", "True", reason, "done"))
    assert kueue.finish(done, True, "done", NOW) is None


def test_a_workload_of_the_name_that_is_not_the_jobs_holds_the_pods() -> None:
    job = queued_job()
    body = workload_body(job, *ADMITTED)
    body["metadata"]["ownerReferences"] = []
    foreign = kueue.WorkloadState.from_body(body, job.ref.uid)
    plan = decide(
        job, {}, Observed(children=INFRA, metastore_ready=True, workload=foreign), NOW, CONFIG, "pw"
    )
    assert "Pod" not in [m["kind"] for m in plan.creates]
    assert conditions.find(plan.status["conditions"], Cond.ADMITTED)["reason"] == Reason.NAME_TAKEN


def test_pods_of_a_job_that_lost_its_workload_are_stopped() -> None:
    job = queued_job()
    observed = Observed(pods=(pod(0), pod(1)), children=INFRA, metastore_ready=True)
    plan = decide(job, running_status(), observed, NOW, CONFIG, "pw")
    assert plan.status["phase"] == Phase.SUSPENDED and len(plan.deletes) == 2
    assert "Workload" in [m["kind"] for m in plan.creates]


def test_pods_go_to_the_nodes_of_the_flavors_kueue_admitted_them_to() -> None:
    job = queued_job(scheduling={"nodeSelector": {"pool": "mine", "zone": "a"}})
    body = workload_body(job, *ADMITTED, admission=True)
    body["status"]["admission"]["podSetAssignments"] = [
        {"name": "workers", "flavors": {"nvidia.com/gpu": "h200"}}
    ]
    admitted = kueue.WorkloadState.from_body(body, job.ref.uid)
    assert admitted.flavors == ("h200",)
    toleration = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    flavor = {"spec": {"nodeLabels": {"zone": "b", "gpu": "h200"}, "tolerations": [toleration]}}
    placement = kueue.Placement.from_flavors([flavor])
    observed = Observed(children=INFRA, metastore_ready=True, workload=admitted, workload_placement=placement)
    plan = decide(job, {}, observed, NOW, CONFIG, "pw")
    created = [m for m in plan.creates if m["kind"] == "Pod"]
    assert len(created) == 2
    for worker in created:
        assert worker["spec"]["nodeSelector"] == {"pool": "mine", "zone": "b", "gpu": "h200"}, (
            "the flavor's win"
        )
        assert toleration in worker["spec"]["tolerations"] and len(worker["spec"]["tolerations"]) == 2
    assert kueue.place(created[0], placement) == created[0], "placing twice changes nothing"
    assert kueue.place(created[0], None) is created[0]
