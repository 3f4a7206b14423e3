"""The suspend policy: drain the running pods (finish the step's weight sync, checkpoint), then delete them;
on resume, withdraw the checkpoint request first. Pure: decide.py calls it with its Pass.

A suspend (the user's spec.suspend, Kueue's eviction, or the operator's own on a rollout breach) lets the
running pods end their step within spec.runPolicy.suspendGracePeriodSeconds: the weight sync in flight
finishes and every trainer rank that registered for checkpoint requests checkpoints and acknowledges.
status.suspension says when the request was made, why the pods went and after which step.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from colocate_operator import conditions, steps
from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decision import SOON, CheckpointWrite, Pass, Plan, PodRef, live_refs, parse_time
from colocate_operator.observed import CheckpointState
from colocate_operator.status import SuspensionStatus

# status.weightSync.currentPhase while a step's weights are on their way (between the trainer's publish and
# its finished record); the step follower writes a phase change within its heartbeat (stepwatch.py).
SYNC_IN_FLIGHT = frozenset(
    steps.PHASE_NAMES[phase] for phase in ("published", "opened", "copied", "closed", "acked", "freed")
)
DRAIN_RECHECK = 2.0  # seconds between two looks at the checkpoint ACKs (each one a meta-store round trip)


def suspend(p: Pass, creates: list[dict[str, object]], redis_restart: list[PodRef]) -> Plan:
    """Drain (until done or the grace period ends), then delete every pod; the meta-store, the claim
    template and the Services stay."""
    if p.phase != Phase.SUSPENDED:
        waiting = _drain(p, creates)
        if waiting is not None:
            return waiting
    deletes = live_refs(p.observed.pods) + redis_restart
    # Like a Job's: the active deadline counts from the (re)start, so a suspended job (a Kueue-preempted one,
    # say) does not fail DeadlineExceeded as soon as it resumes. Pod creation on resume sets it again.
    p.set(start_time=None, phase=Phase.SUSPENDED, group_created=False)
    suspension = p.desired.suspension or SuspensionStatus()
    message = f"{stopped(suspension)}; meta-store, claim template and Services kept"
    p.condition(Cond.SUSPENDED, True, p.suspended_by, message)
    p.condition(Cond.PODS_READY, False, p.suspended_by, "suspended")
    p.condition(Cond.RESOURCES_ALLOCATED, False, p.suspended_by, "suspended")
    if p.status.condition(Cond.RESTARTING):
        p.condition(Cond.RESTARTING, False, p.suspended_by, "suspended")
    if p.phase != Phase.SUSPENDED:
        late = suspension.outcome == "GracePeriodExpired"
        p.event(
            "Warning" if late else "Normal",
            p.suspended_by,
            f"Suspended: {stopped(suspension)}; deleting {len(deletes)} pods",
        )
    return p.plan(
        creates=creates,
        deletes=deletes,
        persist_first=p.phase != Phase.SUSPENDED,
        requeue_after=SOON if p.observed.pods else None,
    )


def _drain(p: Pass, creates: list[dict[str, object]]) -> Plan | None:
    """The plan that waits for the running pods to end their step, or None once they may go (the desired
    status.suspension then says why and after which step)."""
    previous = p.status.suspension or SuspensionStatus()
    began = parse_time(previous.request_time) if p.phase == Phase.SUSPENDING else None
    began = began or p.now
    request_id = conditions.timestamp(began)
    checkpoint = p.observed.checkpoint
    ranks = checkpoint.ranks if checkpoint is not None and checkpoint.readable else frozenset()
    acks = {
        rank: step
        for rank, (ack_id, step) in (checkpoint.acks.items() if checkpoint is not None else ())
        if rank in ranks and ack_id == request_id
    }
    requested = bool(ranks) or bool(previous.checkpoint_requested and p.phase == Phase.SUSPENDING)
    suspension = SuspensionStatus(request_time=request_id, checkpoint_requested=True if requested else None)
    outcome = _drain_outcome(p, began, checkpoint, ranks, acks)
    if outcome is not None:
        p.set(suspension=_drained(suspension, outcome, acks, p.status.last_completed_step))
        return None
    if ranks and checkpoint is not None and checkpoint.request_id != request_id:
        p.checkpoint = CheckpointWrite(request_id=request_id, reason=_suspend_reason(p))
    p.set(suspension=suspension, phase=Phase.SUSPENDING)
    return _wait(p, creates, began, checkpoint, ranks, acks)


def _drain_outcome(
    p: Pass,
    began: datetime,
    checkpoint: CheckpointState | None,
    ranks: frozenset[int],
    acks: dict[int, int],
) -> str | None:
    """Why the pods may go now, or None while they drain. A checkpoint request is outstanding only while a
    trainer rank registered for it (`ranks`); the store stopped answering after the request was written:
    the request stays on record (`checkpointRequested`)."""
    grace = p.job.spec.run_policy.suspend_grace_period_seconds
    live = [pod for pod in p.observed.pods if pod.owned and not pod.deleting and pod.phase == "Running"]
    in_flight = p.status.sync_phase in SYNC_IN_FLIGHT
    if grace <= 0:
        return "Immediate"
    if ranks and len(acks) == len(ranks):
        return "Checkpointed"  # also when a trainer exited right after its ACK
    if not live:
        return "NoRunningPods"
    if not ranks and not in_flight and not (checkpoint is not None and checkpoint.pending):
        return "SyncFinished"  # not while the first read of the records is on its way
    if p.now >= began + timedelta(seconds=grace):
        return "GracePeriodExpired"
    return None


def _drained(
    suspension: SuspensionStatus, outcome: str, acks: dict[int, int], last_step: int | None
) -> SuspensionStatus:
    after: int | None = last_step
    checkpoint_step: int | None = None
    if outcome == "Checkpointed":
        checkpoint_step = min(acks.values())
        after = max(checkpoint_step, last_step or 0)
    return suspension.model_copy(
        update={"outcome": outcome, "after_step": after, "checkpoint_step": checkpoint_step}
    )


def _wait(
    p: Pass,
    creates: list[dict[str, object]],
    began: datetime,
    checkpoint: CheckpointState | None,
    ranks: frozenset[int],
    acks: dict[int, int],
) -> Plan:
    grace = p.job.spec.run_policy.suspend_grace_period_seconds
    deadline = began + timedelta(seconds=grace)
    if ranks:
        waiting = f"{len(acks)}/{len(ranks)} trainer ranks acknowledged the checkpoint request"
    else:
        last_step = p.status.last_completed_step
        where = f" (step {last_step + 1})" if last_step is not None else ""
        waiting = f"the weight sync in flight{where} is in phase {p.status.sync_phase}"
        if checkpoint is not None and not checkpoint.readable:
            waiting += "; the meta-store " + (
                "has not answered yet"
                if checkpoint.pending
                else "did not answer, so no checkpoint was requested"
            )
    message = (
        f"suspend requested: {waiting}; the pods are deleted when it is done or at "
        f"{conditions.timestamp(deadline)} (spec.runPolicy.suspendGracePeriodSeconds={grace})"
    )
    p.condition(Cond.SUSPENDED, False, Reason.WAITING_FOR_CHECKPOINT, message)
    if p.phase != Phase.SUSPENDING:
        p.event("Normal", Reason.SUSPENDING, f"Suspending: {message}")
    return p.plan(
        creates=creates,
        persist_first=p.phase != Phase.SUSPENDING,  # the grace period's start, before the request is written
        requeue_after=min(DRAIN_RECHECK, max(0.0, (deadline - p.now).total_seconds())),
    )


def _suspend_reason(p: Pass) -> str:
    by = "evicted by Kueue" if p.suspended_by == Reason.EVICTED_BY_KUEUE else "suspended (spec.suspend)"
    return f"ColocateJob {p.job.ref.namespace}/{p.job.ref.name} {by}"


def stopped(suspension: SuspensionStatus) -> str:
    """Which step the pods stopped after and why then, from status.suspension (the same words every pass)."""
    after = suspension.after_step
    where = f"after step {after}" if after is not None else "before any step completed"
    why = {
        "Checkpointed": f"the trainer checkpointed after step {suspension.checkpoint_step}",
        "GracePeriodExpired": "the grace period ran out before the trainer acknowledged a checkpoint"
        if suspension.checkpoint_requested
        else "the grace period ran out before the weight sync in flight finished",
        "SyncFinished": "no weight sync in flight and no trainer registered for checkpoint requests",
        "NoRunningPods": "no pod was running",
        "Immediate": "spec.runPolicy.suspendGracePeriodSeconds is 0",
    }.get(suspension.outcome or "", "")
    return f"pods deleted {where}" + (f" ({why})" if why else "")


def withdraw_checkpoint_request(p: Pass) -> None:
    """On resume (or a suspend called off while it waited): the request a new trainer must not see goes, and
    the resume step is put back if the store lost it, before any pod is created."""
    suspension = p.status.suspension or SuspensionStatus()
    if p.phase in (Phase.SUSPENDED, Phase.SUSPENDING) and suspension.checkpoint_requested:
        step = suspension.checkpoint_step if p.phase == Phase.SUSPENDED else None
        p.checkpoint = CheckpointWrite(withdraw=True, resume_step=step)
        error = p.observed.checkpoint_write_error
        if error:  # the executor creates the meta-store's children (a lost Secret) but holds back the pods
            p.condition(
                Cond.SUSPENDED,
                False,
                Reason.CHECKPOINT_REQUEST_NOT_WITHDRAWN,
                "resuming: the pods are created once the suspend's checkpoint request is withdrawn from the "
                f"meta-store, which failed: {error}",
            )
