"""What the current pod group shows: its counts, SGLang's in-place restarts, and why it must restart. Pure.

The current group is the owned pods of the status's incarnation (`restarts`) with an index in range; every
other pod is stale (an old group's, waiting to go).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from colocate_operator import names
from colocate_operator.constants import Cond, Reason
from colocate_operator.decision import Pass, PodRef, min_delay
from colocate_operator.observed import ClaimState, PodState
from colocate_operator.spec import ColocateJob
from colocate_operator.status import ClaimStatus, EnginesPart, PodsPart, ReplicaStatus


@dataclass(frozen=True)
class Group:
    current: list[PodState]  # by index
    stale: list[PodState]

    @classmethod
    def of(cls, p: Pass, restarts: int) -> Group:
        current = sorted(
            (
                pod
                for pod in p.observed.pods
                if pod.owned and pod.restart == restarts and pod.index is not None and 0 <= pod.index < p.n
            ),
            key=lambda pod: pod.index or 0,
        )
        return cls(current, [pod for pod in p.observed.pods if pod not in current])


def ready_count(current: list[PodState]) -> int:
    return sum(1 for pod in current if pod.ready and pod.phase == "Running")


def unplaced(current: list[PodState]) -> list[PodState]:
    return [pod for pod in current if not pod.scheduled and pod.phase == "Pending" and not pod.deleting]


def unschedulable_detail(unplaced: list[PodState]) -> str:
    pod = unplaced[0]
    more = f" (and {len(unplaced) - 1} more)" if len(unplaced) > 1 else ""
    return f"pod {pod.name}{more}: {pod.unschedulable or 'not scheduled yet'}"


def pods_part(p: Pass, current: list[PodState]) -> PodsPart:
    ready = ready_count(current)
    replicas = ReplicaStatus(
        desired=p.n,
        created=len(current),
        scheduled=sum(1 for pod in current if pod.scheduled),
        running=sum(1 for pod in current if pod.phase == "Running"),
        ready=ready,
        failed=sum(1 for pod in current if pod.phase == "Failed"),
    )
    claims = []
    for pod in current:
        if pod.claim:
            state = p.observed.claims.get(pod.claim) or ClaimState(pod.claim, False)
            claims.append(
                ClaimStatus(pod=pod.name, claim=pod.claim, allocated=state.allocated, devices=state.devices)
            )
    return PodsPart(replicas=replicas, ready=f"{ready}/{p.n}", resource_claims=tuple(claims))


def engine_restarts(p: Pass, current: list[PodState]) -> tuple[EnginesPart, bool]:
    """Count SGLang's in-place restarts (the kubelet's restartCount of the rollout container) into
    status.engineRestarts, and say on EngineRecovered whether it serves again. Such a restart is no group
    restart: the trainer runs on and re-pushes its weights to the new engine (runtime/colocated/repush.py),
    and runPolicy.maxRestarts is not spent. Also returns whether an engine is coming back right now.

    engineRestartsCounted holds the current group's restarts already counted: a count below it means new
    pods (a resume), counted from zero."""
    before, counted = p.status.engine_restarts, p.status.engine_restarts_counted
    total = before or 0
    seen = sum(pod.engine_restarts for pod in current)
    fresh = seen if seen < (counted or 0) else seen - (counted or 0)
    if fresh:
        total += fresh
        _engine_restarted_event(p, [pod for pod in current if pod.engine_restarts])
    # Written once there is something to say, and kept from then on (None: not written).
    part = EnginesPart(
        engine_restarts=total if total or before is not None else None,
        engine_restarts_counted=seen if seen or counted is not None else None,
    )
    return part, _engine_recovered(p, current, total)


def _engine_restarted_event(p: Pass, restarted: list[PodState]) -> None:
    codes = sorted({pod.engine_last_exit_code for pod in restarted if pod.engine_last_exit_code is not None})
    p.event(
        "Warning",
        Reason.ENGINE_RESTARTED,
        f"SGLang restarted in place in pod{'s' if len(restarted) > 1 else ''} "
        f"{', '.join(pod.name for pod in restarted)}"
        + (f" (exit code {', '.join(map(str, codes))})" if codes else "")
        + "; the trainer keeps running and re-pushes its weights; no group restart",
    )


def _engine_recovered(p: Pass, current: list[PodState], total: int) -> bool:
    """EngineRecovered, once SGLang ever restarted in place; whether an engine is coming back now."""
    if not total:
        return False
    coming = [
        pod for pod in current if pod.engine_restarts and not pod.engine_ready and pod.phase == "Running"
    ]
    if coming:
        pod = coming[0]
        p.condition(
            Cond.ENGINE_RECOVERED,
            False,
            Reason.ENGINE_RESTARTING,
            f"the SGLang container of pod {pod.name} restarted in place ({pod.engine_restarts} times in this "
            "group) and is not serving yet; the trainer re-pushes its weights once it is",
        )
    else:
        p.condition(
            Cond.ENGINE_RECOVERED,
            True,
            Reason.ENGINE_SERVING,
            f"SGLang restarted in place {total} time{'s' if total != 1 else ''} and serves again; "
            "runPolicy.maxRestarts was not spent on it",
        )
    return bool(coming)


def group_failure(job: ColocateJob, current: list[PodState], group_created: bool) -> tuple[str, str] | None:
    """Why the current group must be restarted (the final step is not recorded), or None. A missing pod
    counts only once all existed."""
    for pod in current:
        if pod.phase == "Failed":
            return (Reason.POD_EVICTED if pod.reason == "Evicted" else Reason.POD_FAILED), pod.describe()
    crash_loop = _engine_crash_loop(job, current)
    if crash_loop is not None:
        return Reason.ENGINE_CRASH_LOOPING, crash_loop
    for pod in current:
        if pod.engine_exit_code not in (None, 0) and not pod.engine_restart_in_place:
            return (
                Reason.ENGINE_EXITED,
                f"the SGLang container of pod {pod.name} exited with code {pod.engine_exit_code} and this "
                "cluster does not restart a container alone (the ContainerRestartRules feature is off)",
            )
    for pod in current:
        if pod.phase == "Succeeded":
            return (
                Reason.POD_EXITED_WITHOUT_FINAL_STEP,
                f"pod {pod.name} exited before the trainer recorded its final step",
            )
    if group_created:
        return _missing(job, current)
    return None


def _missing(job: ColocateJob, current: list[PodState]) -> tuple[str, str] | None:
    for pod in current:
        if pod.deleting:
            return Reason.POD_DELETED, f"pod {pod.name} was deleted"
    present = {pod.index for pod in current}
    missing = [i for i in range(job.spec.num_nodes) if i not in present]
    if missing:
        return Reason.POD_DELETED, f"pod {names.pod(job.ref.name, missing[0])} disappeared"
    return None


def _engine_crash_loop(job: ColocateJob, current: list[PodState]) -> str | None:
    """SGLang restarted in place more often in this group than runPolicy.maxEngineRestarts allows (issue 30,
    item 7): the group restarts rather than leave the job Running with an engine that never serves."""
    seen = sum(pod.engine_restarts for pod in current)
    limit = job.spec.run_policy.max_engine_restarts
    if seen <= limit:
        return None
    worst = max(current, key=lambda pod: pod.engine_restarts)
    code = worst.engine_last_exit_code
    return (
        f"SGLang restarted in place {seen} times in this group, more than spec.runPolicy.maxEngineRestarts="
        f"{limit} (pod {worst.name}: {worst.engine_restarts} restarts"
        + (f", last exit code {code}" if code is not None else "")
        + ")"
    )


def placement_deadline(p: Pass, current: list[PodState], group_created: bool) -> datetime | None:
    """When a partly placed group must give its GPUs back: the placed pods hold GPUs the unplaced ones wait
    for, and maybe the other way round in another job (two half-placed gangs never finish)."""
    waiting = unplaced(current)
    if not group_created or not waiting or len(waiting) == len(current):
        return None
    created = [pod.created for pod in current if pod.created is not None]
    if not created:
        return None
    return max(created) + timedelta(seconds=p.job.spec.scheduling.placement_timeout_seconds)


def placement_timeout(p: Pass, current: list[PodState], group_created: bool) -> tuple[str, str] | None:
    deadline = placement_deadline(p, current, group_created)
    if deadline is None or p.now < deadline:
        return None
    waiting = unplaced(current)
    timeout = p.job.spec.scheduling.placement_timeout_seconds
    return (
        Reason.PLACEMENT_TIMEOUT,
        f"only {len(current) - len(waiting)}/{p.n} pods were placed within "
        f"spec.scheduling.placementTimeoutSeconds={timeout}, so the placed ones give their GPUs back; "
        f"{unschedulable_detail(waiting)}",
    )


def force_delete_stuck(p: Pass) -> None:
    """Pods still Terminating `force_delete_after_seconds` past their grace period sit on a node whose
    kubelet no longer answers; with fixed pod names they would block the group restart forever. They are
    deleted with grace 0 (the plan wakes up when the next one is due)."""
    grace = timedelta(seconds=p.config.force_delete_after_seconds)
    for pod in p.observed.pods:
        if not pod.deleting or pod.delete_by is None:
            continue
        due = pod.delete_by + grace
        if p.now < due:
            p.wake = min_delay(p.wake, (due - p.now).total_seconds())
            continue
        p.force_deletes.append(PodRef.of(pod))
        late = int((p.now - pod.delete_by).total_seconds())
        where = f" on node {pod.node}" if pod.node else ""
        p.event(
            "Warning",
            Reason.FORCE_DELETED_POD,
            f"pod {pod.name}{where} was still terminating {late} s after its grace period ended (its node "
            "does not confirm the deletion): deleted with grace period 0",
        )
