"""The I/O for a job Kueue queues (kueue.py holds the decisions' pure parts): read its Workload and the
value of its WorkloadPriorityClass before a pass decides, write what the job integration owes Kueue after.

Read every pass of a queued job (one GET): admission is Kueue's to change at any time, and a watch event on
the Workload queues the job (handlers.py). Nothing is read for a job without a queue.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime

from colocate_operator import kube, kueue
from colocate_operator.decide import Plan
from colocate_operator.observed import Observed
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView

log = logging.getLogger("colocate_operator.workloads")


def observe(api: kube.Kube, job: ColocateJob, observed: Observed) -> Observed:
    if kueue.queue_name(job) is None:
        return observed
    body = api.get(kube.WORKLOADS, job.ref.namespace, kueue.workload_name(job.ref.name))
    if body is not None:
        state = kueue.WorkloadState.from_body(body, job.ref.uid)
        placement = None
        if state.owned and state.admitted and not state.evicted and state.flavors:
            # Read while admitted: the pods are created (or re-created) on the flavors' nodes.
            flavors = [api.get(kube.RESOURCE_FLAVORS, None, name) for name in state.flavors]
            placement = kueue.Placement.from_flavors([f for f in flavors if f is not None])
        return replace(observed, workload=state, workload_placement=placement)
    klass = kueue.priority_class(job)
    if klass is None:
        return observed
    found = api.get(kube.WORKLOAD_PRIORITY_CLASSES, None, klass)
    # Missing: the Workload is created without a value and Kueue treats it as priority 0.
    value = found.get("value") if found else None
    return replace(observed, workload_priority=int(value) if value is not None else None)


def write(api: kube.Kube, job: ColocateJob, observed: Observed, plan: Plan, now: datetime) -> None:
    """Finish the Workload of a finished job; hand an evicted one's quota back once its pods are gone.
    A write that lost a race (409) is retried by the next pass, which reads the Workload again."""
    state = observed.workload
    if state is None or not state.owned:
        return
    view = StatusView(plan.status)
    phase = view.phase
    if phase in ("Succeeded", "Failed"):
        found = view.condition(phase)
        patch = kueue.finish(state, phase == "Succeeded", (found or {}).get("message") or phase, now)
    elif not observed.pods and not any(m["kind"] == "Pod" for m in plan.creates):
        patch = kueue.clear_admission(state, now)
    else:
        patch = None
    if patch is None:
        return
    name = kueue.workload_name(job.ref.name)
    try:
        api.patch(kube.WORKLOADS, job.ref.namespace, name, patch, subresource="status")
    except kube.KubeError as e:
        if e.status in (404, 409):
            return
        raise
    log.info(
        "workload status written",
        extra={"job": f"{job.ref.namespace}/{job.ref.name}", "workload": name, "phase": phase},
    )
