"""A ColocateJob as a Kueue workload of its own: the Workload manifest, what Kueue said about it, and the
status changes a job integration owes Kueue. Pure: no API calls, no clock.

A job with a queue (the label `kueue.x-k8s.io/queue-name` on the job, or spec.scheduling.queueName) gets one
Workload (kueue.x-k8s.io/v1beta2, the version Kueue v0.17 stores), owned by the job and named after it, with
one pod set for its one replica group: numNodes pods whose template is the worker pod the builder makes
(pods.pod), so the requests Kueue counts are the pods' own. The job creates no pods until Kueue admits the
Workload (Admitted, i.e. quota reserved and every admission check ready). When Kueue evicts it (Evicted, e.g.
preempted by a higher priority), the job goes through its suspend path; once its pods are gone the
admission is cleared the way Kueue's own job integrations do (jobframework's reconciler: QuotaReserved False
with reason Pending, `status.admission` removed, Admitted synced, Requeued True after a preemption), and Kueue
queues it again. A finished job marks its Workload Finished, which gives the quota back.

The Workload carries no finalizer: deleting the job deletes it (garbage collection), and its quota is free
at once, also while the operator is down.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from colocate_operator import names
from colocate_operator.conditions import timestamp
from colocate_operator.constants import COMPONENT_WORKER, KUEUE_QUEUE_LABEL
from colocate_operator.spec import ColocateJob

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
PRIORITY_CLASS_LABEL = f"{GROUP}/priority-class"  # names a WorkloadPriorityClass, as on Kueue's own jobs
JOB_UID_LABEL = f"{GROUP}/job-uid"  # Kueue names the preempting job by it in a victim's message
PODSET = "workers"
# Workload condition types and the reasons the integration writes (Kueue's API constants).
QUOTA_RESERVED, ADMITTED, EVICTED, REQUEUED, FINISHED = (
    "QuotaReserved",
    "Admitted",
    "Evicted",
    "Requeued",
    "Finished",
)
REQUEUE_REASONS = ("Preempted", "NodeFailures")  # Requeued is True only after these evictions


def queue_name(job: ColocateJob) -> str | None:
    """The LocalQueue the job waits in, or None (not managed by Kueue). Kueue's own label wins."""
    return job.labels.get(KUEUE_QUEUE_LABEL) or job.spec.scheduling.queue_name or None


def priority_class(job: ColocateJob) -> str | None:
    return job.labels.get(PRIORITY_CLASS_LABEL) or None


def workload_name(job: str) -> str:
    """One Workload per job, of a kind no other child has: the job's own name cannot collide."""
    return job


def podset_template(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod set's template from a worker pod: its spec whole (requests, overhead, node selector,
    affinity, tolerations and claims are what Kueue reads), without one pod's own hostname."""
    spec = {k: v for k, v in pod["spec"].items() if k != "hostname"}
    meta = pod["metadata"]
    template_meta: dict[str, Any] = {"labels": dict(meta.get("labels") or {})}
    if meta.get("annotations"):
        template_meta["annotations"] = dict(meta["annotations"])
    return {"metadata": template_meta, "spec": spec}


def workload(job: ColocateJob, worker_pod: dict[str, Any], priority: int | None) -> dict[str, Any]:
    """The job's Workload; `worker_pod` is pods.pod(...) for this job, `priority` the value of the job's
    WorkloadPriorityClass (Kueue orders and preempts by spec.priority; the reference alone is not read)."""
    queue = queue_name(job)
    assert queue is not None, "only a queued job has a Workload"
    podset: dict[str, Any] = {
        "name": PODSET,
        "count": job.spec.num_nodes,
        "template": podset_template(worker_pod),
    }
    topology = job.spec.scheduling.topology
    if topology.required:
        podset["topologyRequest"] = {"required": topology.required}
    elif topology.preferred:
        podset["topologyRequest"] = {"preferred": topology.preferred}
    spec: dict[str, Any] = {"queueName": queue, "podSets": [podset]}
    klass = priority_class(job)
    if klass is not None:
        spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": klass}
        if priority is not None:
            spec["priority"] = priority
    meta = names.metadata(
        job.ref, workload_name(job.ref.name), COMPONENT_WORKER, extra_labels={JOB_UID_LABEL: job.ref.uid}
    )
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": meta, "spec": spec}


def _condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def _true(conditions: list[dict[str, Any]], type_: str) -> bool:
    found = _condition(conditions, type_)
    return bool(found and found.get("status") == "True")


@dataclass(frozen=True)
class WorkloadState:
    """What Kueue says about the job's Workload."""

    owned: bool
    quota_reserved: bool
    admitted: bool
    finished: bool
    evicted_reason: str | None  # the Evicted condition's reason while it is True (Preempted, ...)
    message: str  # Kueue's own words: why it waits, why it was evicted, where it was admitted
    cluster_queue: str | None
    flavors: tuple[str, ...]  # the ResourceFlavors the admission assigned (their node labels place the pods)
    resource_version: str
    generation: int
    conditions: tuple[dict[str, Any], ...]

    @property
    def evicted(self) -> bool:
        return self.evicted_reason is not None

    @classmethod
    def from_body(cls, body: dict[str, Any], job_uid: str) -> WorkloadState:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        conditions = [dict(c) for c in status.get("conditions") or []]
        evicted = _condition(conditions, EVICTED)
        evicted_reason = (
            str(evicted.get("reason") or "Evicted") if evicted and evicted.get("status") == "True" else None
        )
        quota = _condition(conditions, QUOTA_RESERVED)
        admitted = _condition(conditions, ADMITTED)
        if evicted_reason is not None:
            message = str(evicted.get("message") or "") if evicted else ""
        elif admitted and admitted.get("status") == "True":
            message = str((quota or admitted).get("message") or "")
        else:
            message = str((quota or {}).get("message") or "waiting for Kueue to look at the workload")
        return cls(
            owned=any(ref.get("uid") == job_uid for ref in meta.get("ownerReferences") or []),
            quota_reserved=_true(conditions, QUOTA_RESERVED),
            admitted=_true(conditions, ADMITTED),
            finished=_true(conditions, FINISHED),
            evicted_reason=evicted_reason,
            message=message,
            cluster_queue=(status.get("admission") or {}).get("clusterQueue"),
            flavors=tuple(
                sorted(
                    {
                        str(flavor)
                        for assignment in (status.get("admission") or {}).get("podSetAssignments") or []
                        for flavor in (assignment.get("flavors") or {}).values()
                    }
                )
            ),
            resource_version=str(meta.get("resourceVersion") or ""),
            generation=int(meta.get("generation") or 0),
            conditions=tuple(conditions),
        )


def _set(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int,
) -> None:
    """metav1.Condition semantics: lastTransitionTime changes only with the status."""
    value = "True" if status else "False"
    old = _condition(conditions, type_)
    entry = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": timestamp(now)
        if old is None or old.get("status") != value
        else old.get("lastTransitionTime", timestamp(now)),
        "observedGeneration": generation,
    }
    if old is None:
        conditions.append(entry)
    else:
        conditions[conditions.index(old)] = entry


def clear_admission(state: WorkloadState, now: datetime) -> dict[str, Any] | None:
    """The status patch that hands an evicted Workload back to Kueue once the job's pods are gone, as
    jobframework does (SetRequeuedCondition, UnsetQuotaReservationWithCondition); None if nothing to do."""
    if not state.evicted or not state.quota_reserved:
        return None
    conditions = [dict(c) for c in state.conditions]
    message = state.message or "evicted"
    reason = state.evicted_reason or "Evicted"
    _set(conditions, REQUEUED, reason in REQUEUE_REASONS, reason, message, now, state.generation)
    _set(conditions, QUOTA_RESERVED, False, "Pending", message, now, state.generation)
    if _condition(conditions, ADMITTED) is not None:
        _set(
            conditions,
            ADMITTED,
            False,
            "NoReservation",
            "The workload has no reservation",
            now,
            state.generation,
        )
    return {
        "metadata": {"resourceVersion": state.resource_version},
        "status": {"admission": None, "conditions": conditions},
    }


def finish(state: WorkloadState, succeeded: bool, message: str, now: datetime) -> dict[str, Any] | None:
    """The status patch marking the Workload Finished (Kueue then releases its quota); None if it is."""
    if state.finished:
        return None
    conditions = [dict(c) for c in state.conditions]
    reason = "Succeeded" if succeeded else "Failed"
    _set(conditions, FINISHED, True, reason, message or reason, now, state.generation)
    return {"metadata": {"resourceVersion": state.resource_version}, "status": {"conditions": conditions}}


@dataclass(frozen=True)
class Placement:
    """Where the admitted flavors put the pods, as Kueue's job integrations apply it when they start a job:
    the flavors' node labels as a node selector and their tolerations."""

    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]

    @classmethod
    def from_flavors(cls, bodies: list[dict[str, Any]]) -> Placement:
        selector: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for body in bodies:
            spec = body.get("spec") or {}
            selector.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        return cls(selector, tuple(tolerations))


def place(pod: dict[str, Any], placement: Placement | None) -> dict[str, Any]:
    """The worker pod on its admitted flavors' nodes: their labels join (and win over) its node selector,
    their tolerations are added."""
    if placement is None or (not placement.node_selector and not placement.tolerations):
        return pod
    spec = dict(pod["spec"])
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    extra = [t for t in placement.tolerations if t not in (spec.get("tolerations") or [])]
    if extra:
        spec["tolerations"] = [*(spec.get("tolerations") or []), *extra]
    return {**pod, "spec": spec}
