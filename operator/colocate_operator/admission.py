"""Kueue's word on a queued job (its Workload's admission), and the policies that end or stop a running job
without a pod failing: the active deadline, a failed IPC preflight, a rollout breach. Pure.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from colocate_operator import kueue
from colocate_operator.constants import IPC_PREFLIGHT_FAILURES, ROLLOUT_BREACHES, Cond, Phase, Reason
from colocate_operator.decision import Pass, parse_time
from colocate_operator.observed import PodState
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView


def kueue_admission(p: Pass, current: list[PodState]) -> tuple[bool, bool]:
    """(stop, hold) for a job Kueue queues, and its Admitted condition. hold: no pods may be created (the
    Workload is not admitted); stop: pods, or a group that ran, exist without admission (Kueue evicted it,
    or its Workload went), so they go through the suspend path. (False, False) for a job without a queue."""
    queue = kueue.queue_name(p.job)
    if queue is None:
        return False, False
    state = p.observed.workload
    name = kueue.workload_name(p.job.ref.name)
    if state is None:
        reason, message = Reason.QUEUED_BY_KUEUE, f"Workload {name} created in LocalQueue {queue}"
    elif not state.owned:
        reason = Reason.NAME_TAKEN
        message = f"Workload {name} exists and is not this job's; no pods until it is gone"
    elif state.evicted:  # before admitted: Kueue keeps Admitted True until the job gave its quota back
        reason = Reason.EVICTED_BY_KUEUE
        message = f"Kueue evicted Workload {name} ({state.evicted_reason}): {state.message}"
    elif state.admitted:
        where = f" by ClusterQueue {state.cluster_queue}" if state.cluster_queue else ""
        p.condition(Cond.ADMITTED, True, Reason.ADMITTED_BY_KUEUE, f"Workload {name} admitted{where}")
        return False, False
    else:
        reason, message = Reason.QUEUED_BY_KUEUE, f"Workload {name} in LocalQueue {queue}: {state.message}"
    p.condition(Cond.ADMITTED, False, reason, message)
    ran = bool(current or p.observed.pods or p.desired.group_created) or p.phase not in (Phase.PENDING,)
    if ran:
        p.suspended_by = Reason.EVICTED_BY_KUEUE
    return ran, True


def deadline(p: Pass) -> tuple[int, datetime] | None:
    """spec.runPolicy.activeDeadlineSeconds and when the job (re)started, when both are set."""
    seconds = p.job.spec.run_policy.active_deadline_seconds
    start = parse_time(p.status.start_time)
    return (seconds, start) if seconds and start else None


def policy_failure(p: Pass) -> tuple[str, str] | None:
    """Why the job fails without a pod failing (reason, message): its deadline passed, its IPC preflight
    failed in Fail mode, or its rollouts drifted with action Fail."""
    limit = deadline(p)
    if limit is not None and p.now >= limit[1] + timedelta(seconds=limit[0]):
        return (
            Reason.DEADLINE_EXCEEDED,
            f"the job ran longer than spec.runPolicy.activeDeadlineSeconds={limit[0]}",
        )
    ipc_failure = ipc_preflight_failure(p.job, dict(p.status.raw))
    if ipc_failure is not None:
        return Reason.IPC_PREFLIGHT_FAILED, ipc_failure
    drift = rollout_breach(p.job, dict(p.status.raw), "Fail")
    if drift is not None:
        return Reason.ROLLOUT_INCONSISTENT, drift
    return None


def ipc_preflight_failure(job: ColocateJob, status: dict[str, Any]) -> str | None:
    """Why a job whose spec says `ipcPreflight.mode: Fail` fails: IPCReady (written by the step consumer) is
    False with a failure reason. Pending (PreflightPending) is no failure; Wait and Off never fail here."""
    if job.spec.weight_sync.ipc_preflight.mode != "Fail":
        return None
    found = StatusView(status).condition(Cond.IPC_READY)
    if not found or found.get("status") != "False" or found.get("reason") not in IPC_PREFLIGHT_FAILURES:
        return None
    return f"IPC preflight failed ({found.get('reason')}): {found.get('message') or 'no detail'}"


def rollout_breach(job: ColocateJob, status: dict[str, Any], action: str) -> str | None:
    """What breached, when spec.weightSync.rolloutConsistency.action is `action` and RolloutConsistent (the
    step consumer's) says the last rollout report breached; else None. The message names the step and KL."""
    if job.spec.weight_sync.rollout_consistency.action != action:
        return None
    found = StatusView(status).condition(Cond.ROLLOUT_CONSISTENT)
    if not found or found.get("status") != "False" or found.get("reason") not in ROLLOUT_BREACHES:
        return None
    return f"the engine's log-probs drifted from the trainer's: {found.get('message') or found.get('reason')}"
