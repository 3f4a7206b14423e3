"""Whether this pass creates the group's missing pods, and if not, what PodsReady says holds them up. Pure.

A checklist, in order: the first check that holds the pods back wins; when none does, the pods are created.
Only before the group exists (`groupCreated` false: a new job, a restart, a resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from colocate_operator import conditions, gpus, kueue, pods
from colocate_operator.conditions import Condition
from colocate_operator.constants import Cond, Reason
from colocate_operator.decision import SOON, Pass, create_retry_at, parse_time
from colocate_operator.metastore import MetaStoreEndpoint
from colocate_operator.observed import CreateRefusal, PodState
from colocate_operator.transitions import backoff_capped, restart_delay

NAME_TAKEN_RECHECK = 10.0  # a child name held by someone else: look again now and then, not at 1 Hz


@dataclass(frozen=True)
class GateInputs:
    current: list[PodState]
    stale: list[PodState]
    store: MetaStoreEndpoint
    kueue_hold: bool  # a queued job Kueue has not admitted
    name_taken: str  # what holds the job's child names, "" when nothing does
    secret_ours: bool  # the meta-store's Secret exists as this job's, or is created in this pass

    @property
    def present(self) -> set[int | None]:
        return {pod.index for pod in self.current if not pod.deleting}


@dataclass
class Gate:
    """What the gate decided: PodsReady's override, when to look again, the pods it creates."""

    condition: Condition | None = None
    requeue: float | None = None
    creates: list[dict[str, Any]] = field(default_factory=list)


def _hold(reason: str, message: str, requeue: float | None = None) -> Gate:
    return Gate(Condition(Cond.PODS_READY, False, reason, message), requeue)


def _old_pods(p: Pass, g: GateInputs) -> Gate | None:
    if not g.stale and len(g.present) == len(g.current):
        return None
    return _hold(Reason.WAITING_FOR_OLD_PODS, _old_pods_message(p, g.stale, g.current), SOON)


def _all_present(p: Pass, g: GateInputs) -> Gate | None:
    if len(g.present) != p.n:
        return None
    p.set(group_created=True)
    return Gate()


def _backoff(p: Pass, g: GateInputs) -> Gate | None:
    restarts = p.desired.restarts
    delay = restart_delay(restarts, p.job.spec.run_policy.backoff_seconds, p.config.max_backoff_seconds)
    ready_at = (parse_time(p.status.last_restart_time) or p.now) + timedelta(seconds=delay)
    if p.now >= ready_at:
        return None
    return _hold(
        Reason.WAITING_FOR_BACKOFF,
        f"restart {restarts} creates pods at {conditions.timestamp(ready_at)}"
        + backoff_capped(p.job, p.config),
        (ready_at - p.now).total_seconds(),
    )


def _device_class(p: Pass, g: GateInputs) -> Gate | None:
    # Reported by ResourcesAllocated: pods would only sit unschedulable.
    return Gate() if gpus.uses_dra(p.job) and p.observed.device_class_found is False else None


def _queued(p: Pass, g: GateInputs) -> Gate | None:
    return (
        _hold(Reason.QUEUED_BY_KUEUE, "pods are created once Kueue admits the job") if g.kueue_hold else None
    )


def _store_refused(p: Pass, g: GateInputs) -> Gate | None:
    # Reported by MetaStoreReady: the pods would send the password to a refused address.
    return None if g.store.allowed else Gate()


def _privileged(p: Pass, g: GateInputs) -> Gate | None:
    privileged = pods.privileged_fields(p.job.spec)
    if not privileged or p.config.allows_privileged(p.job.ref.namespace):
        return None
    message = (
        f"pods are not created: {', '.join(privileged)} ask for privileges Pod Security "
        f"restricted refuses, and namespace {p.job.ref.namespace} is not among the operator's "
        "privileged namespaces (chart value security.allowPrivilegedNamespaces, "
        "--allow-privileged-namespace)"
    )
    if p.previous_reason(Cond.PODS_READY) != Reason.PRIVILEGED_NOT_ALLOWED:
        p.event("Warning", Reason.PRIVILEGED_NOT_ALLOWED, message)
    return _hold(Reason.PRIVILEGED_NOT_ALLOWED, message)


def _name_taken(p: Pass, g: GateInputs) -> Gate | None:
    # The pods would dial (and send the password to) whatever holds the meta-store's names.
    if not g.name_taken and g.secret_ours:
        return None
    return _hold(Reason.NAME_TAKEN, f"pods are not created: {g.name_taken}", NAME_TAKEN_RECHECK)


def _refused(p: Pass, g: GateInputs) -> Gate | None:
    # Refused by admission (a quota, a policy): not again before the backoff ends, whatever pass.
    refusal = pod_refusal(p)
    if refusal is None or p.now >= create_retry_at(refusal):
        return None
    return _hold(
        Reason.CREATE_REFUSED, refusal_message(refusal), (create_retry_at(refusal) - p.now).total_seconds()
    )


CHECKS: tuple[Callable[[Pass, GateInputs], Gate | None], ...] = (
    _old_pods,
    _all_present,
    _backoff,
    _device_class,
    _queued,
    _store_refused,
    _privileged,
    _name_taken,
    _refused,
)


def gate(p: Pass, g: GateInputs) -> Gate:
    for check in CHECKS:
        held = check(p, g)
        if held is not None:
            return held
    return _create(p, g)


def _create(p: Pass, g: GateInputs) -> Gate:
    restarts = p.desired.restarts
    refusal = pod_refusal(p)  # trying again: the condition keeps the server's words meanwhile
    made = Gate(
        Condition(Cond.PODS_READY, False, Reason.CREATE_REFUSED, refusal_message(refusal))
        if refusal
        else None,
        SOON,
    )
    made.creates = [
        kueue.place(pods.pod(p.job, i, restarts, g.store, p.config), p.observed.workload_placement)
        for i in range(p.n)
        if i not in g.present
    ]
    if p.desired.start_time is None:
        p.set(start_time=conditions.timestamp(p.now))
    p.event(
        "Normal",
        Reason.CREATED_PODS,
        f"Creating pods {', '.join(m['metadata']['name'] for m in made.creates)} (group restart {restarts})",
    )
    return made


def pod_refusal(p: Pass) -> CreateRefusal | None:
    return next((r for r in p.observed.create_refusals if r.kind == "Pod"), None)


def refusal_message(refusal: CreateRefusal) -> str:
    times = "once" if refusal.attempts == 1 else f"{refusal.attempts} times in a row"
    return (
        f"the API server refused creating {refusal.kind.lower()} {refusal.name} ({times}; next attempt at "
        f"{conditions.timestamp(create_retry_at(refusal))}): {refusal.message}"
    )


def _old_pods_message(p: Pass, stale: list[PodState], current: list[PodState]) -> str:
    waiting = [pod for pod in (*stale, *current) if pod.deleting or pod in stale]
    message = f"waiting for {len(waiting)} old pods to terminate"
    late = [pod for pod in waiting if pod.deleting and pod.delete_by is not None and p.now > pod.delete_by]
    if late:
        pod = late[0]
        due = pod.delete_by + timedelta(seconds=p.config.force_delete_after_seconds)  # type: ignore[operator]
        message += (
            f"; pod {pod.name}{f' on node {pod.node}' if pod.node else ''} is past its grace period and is "
            f"deleted with grace period 0 at {conditions.timestamp(max(due, p.now))}"
        )
    return message
