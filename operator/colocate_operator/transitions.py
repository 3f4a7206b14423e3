"""The job's transitions that end a pass at once: restart the group, fail, succeed, and the finished job's
upkeep (its TTL). Pure: decide.py calls them with its Pass.

Each one that deletes pods is persisted before the deletion (`persist_first`), so a crash between the two
repeats the deletion, never the transition.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from colocate_operator import conditions
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decision import SOON, Pass, Plan, PodRef, live_refs, parse_time, unfinished_refs
from colocate_operator.observed import PodState
from colocate_operator.spec import ColocateJob


def restart_delay(restarts: int, base_seconds: float, cap_seconds: float) -> float:
    """Backoff before creating group incarnation `restarts`: base, 2*base, 4*base, ... capped."""
    if restarts <= 0 or base_seconds <= 0:
        return 0.0
    return float(min(cap_seconds, base_seconds * 2 ** min(restarts - 1, 30)))


def backoff_capped(job: ColocateJob, config: OperatorConfig) -> str:
    asked = job.spec.run_policy.backoff_seconds
    if asked <= config.max_backoff_seconds:
        return ""
    return (
        f" (spec.runPolicy.backoffSeconds={asked} is above the operator's cap of "
        f"{config.max_backoff_seconds:.0f} s, so the cap applies)"
    )


def restart(
    p: Pass,
    reason: str,
    message: str,
    creates: list[dict[str, Any]],
    also_delete: list[PodRef] | None = None,
) -> Plan:
    restarts = p.desired.restarts + 1
    limit = p.job.spec.run_policy.max_restarts
    p.set(
        phase=Phase.RESTARTING,
        restarts=restarts,
        group_created=False,
        last_restart_time=conditions.timestamp(p.now),
    )
    if p.desired.engine_restarts_counted:
        p.set(engine_restarts_counted=0)  # the new group's SGLang restarts count from zero
    detail = f"{message}; recreating all {p.n} pods (restart {restarts} of {limit})" + backoff_capped(
        p.job, p.config
    )
    p.condition(Cond.RESTARTING, True, reason, detail)
    p.condition(Cond.PODS_READY, False, reason, message)
    p.event("Warning", Reason.RESTARTING_GROUP, detail)
    deletes = live_refs(p.observed.pods) + (also_delete or [])
    return p.plan(creates=creates, deletes=deletes, persist_first=True, requeue_after=SOON)


def restart_or_fail(p: Pass, reason: str, message: str, creates: list[dict[str, Any]]) -> Plan:
    """A group failure: restart the group, or fail the job once every restart is used."""
    limit = p.job.spec.run_policy.max_restarts
    if p.desired.restarts >= limit:
        return fail(p, Reason.MAX_RESTARTS_EXCEEDED, f"{message}; all {limit} restarts used", creates)
    return restart(p, reason, message, creates)


def fail(p: Pass, reason: str, message: str, creates: list[dict[str, Any]]) -> Plan:
    p.set(phase=Phase.FAILED, completion_time=conditions.timestamp(p.now), group_created=False)
    p.condition(Cond.FAILED, True, reason, message)
    p.condition(Cond.PODS_READY, False, reason, message)
    if p.status.condition(Cond.RESTARTING):
        p.condition(Cond.RESTARTING, False, reason, "the job failed")
    p.event("Warning", Reason.JOB_FAILED, f"{reason}: {message}")
    # Keep finished pods for their logs; delete the rest so the GPUs are free.
    ttl = p.job.spec.run_policy.ttl_seconds_after_finished
    return p.plan(
        creates=creates,
        deletes=unfinished_refs(p.observed.pods),
        persist_first=True,
        requeue_after=float(ttl) if ttl is not None else None,
    )


def succeed(
    p: Pass, current: list[PodState], creates: list[dict[str, Any]], stop_engines: list[PodRef]
) -> Plan:
    """The trainer recorded its final step and no pod of the group runs it any more."""
    p.set(phase=Phase.SUCCEEDED, completion_time=conditions.timestamp(p.now))
    failed_after = [pod.describe() for pod in current if pod.phase == "Failed"]
    message = "the trainer recorded its final step" + (
        f"; after it, {'; '.join(failed_after)}" if failed_after else ""
    )
    p.condition(Cond.SUCCEEDED, True, Reason.FINAL_STEP_RECORDED, message)
    p.event("Normal", Reason.JOB_SUCCEEDED, "All pods finished after the trainer recorded its final step")
    return p.plan(creates=creates, deletes=stop_engines, persist_first=True)


def terminal(p: Pass) -> Plan:
    """A finished job: its unfinished pods go, and the job itself once its TTL ran out."""
    deletes = unfinished_refs(p.observed.pods)
    ttl = p.job.spec.run_policy.ttl_seconds_after_finished
    finished = parse_time(p.status.completion_time)
    if ttl is not None and finished is not None:
        expires = finished + timedelta(seconds=ttl)
        if p.now >= expires:
            p.event("Normal", Reason.TTL_EXPIRED, f"Deleting the job {ttl}s after it finished")
            return p.plan(deletes=deletes, delete_job=True)
        return p.plan(deletes=deletes, requeue_after=(expires - p.now).total_seconds())
    return p.plan(deletes=deletes, requeue_after=SOON if deletes else None)
