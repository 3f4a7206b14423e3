"""The reconcile decision: (job, its status, what exists, now) -> a Plan. Pure; no API calls, no clock.

Level-based: the plan depends only on the current state, so running it twice, or after a crash half-way
through the previous one, converges. The only state kept between passes is in the job's status:
`restarts` (the group incarnation; pods carry it as a label), `groupCreated` (whether a missing pod is a
failure or just not created yet), and the timestamps. Transitions that delete pods (restart, fail, suspend)
are persisted before the deletion (`persist_first`), so a crash between the two repeats the deletion, never
the transition (transitions.py).

`decide` is a checklist: the first step that ends the pass returns its Plan. The steps live beside it: the
children to create (children.py), suspend and resume (suspension.py), the policies that fail a job
(admission.py), the group's failures (group.py), pod creation (pod_gate.py) and the parts' conditions
(readiness.py). Each sets its part of the typed status (status.py) on the Pass (decision.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from colocate_operator import children, metastore, names, pods, readiness, suspension, transitions
from colocate_operator.admission import (
    deadline,
    ipc_preflight_failure,
    kueue_admission,
    policy_failure,
    rollout_breach,
)
from colocate_operator.conditions import Condition
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decision import (
    FINISHED,
    SOON,
    CheckpointWrite,
    EventSpec,
    Pass,
    Plan,
    PodRef,
    create_backoff,
    live_refs,
    min_delay,
)
from colocate_operator.group import (
    Group,
    engine_restarts,
    force_delete_stuck,
    group_failure,
    placement_deadline,
    placement_timeout,
    pods_part,
    ready_count,
)
from colocate_operator.observed import Observed, PodState, child_key
from colocate_operator.pod_gate import NAME_TAKEN_RECHECK, GateInputs, gate
from colocate_operator.spec import ColocateJob
from colocate_operator.status import JobStatus, MetaStoreStatus, StatusView
from colocate_operator.transitions import restart_delay

# Beside `decide`, what its callers use of the Plan and of the policies (marks.py: the IPC preflight).
__all__ = [
    "CheckpointWrite",
    "EventSpec",
    "Plan",
    "PodRef",
    "create_backoff",
    "decide",
    "ipc_preflight_failure",
    "restart_delay",
]


def decide(
    job: ColocateJob,
    status: dict[str, Any],
    observed: Observed,
    now: datetime,
    config: OperatorConfig,
    password: str,
) -> Plan:
    """`password` is used only if the meta-store Secret has to be created (the caller draws a fresh one)."""
    store = metastore.endpoint(job, config)
    p = _start(job, StatusView(status), observed, now, config, store)
    # What the pods show, whatever the phase.
    group = Group.of(p, p.desired.restarts)
    p.take(pods_part(p, group.current))
    engines, engine_back_soon = engine_restarts(p, group.current)
    p.take(engines)
    force_delete_stuck(p)
    if p.phase in Phase.TERMINAL:
        return transitions.terminal(p)
    # The children that outlive pod groups, and what stands in their way.
    kids = _children(p, group.current, store, password)
    taken = readiness.names_taken(p)
    meta_ready = readiness.metastore_ready(p, store)
    kueue_stop, kueue_hold = kueue_admission(p, group.current)
    # The first of these that ends the pass wins: suspend, a policy's failure, the final record, a lost
    # Secret, a group failure.
    if job.spec.suspend or kueue_stop:
        return _suspend(p, kids)
    failure = policy_failure(p)
    if failure is not None:
        return transitions.fail(p, *failure, kids.creates)
    _resume(p)
    final = _FinalRecord.of(p, group.current)
    ended = _final(p, group, final, kids) or _lost_secret(p, group, kids) or _failure(p, group, final, kids)
    if ended is not None:
        return ended
    # Running, or on the way: create what is missing and say where the job stands.
    running = _Running(group, kids, store, kueue_hold, taken, meta_ready, engine_back_soon)
    return _run(p, final, running)


def _start(
    job: ColocateJob,
    status: StatusView,
    observed: Observed,
    now: datetime,
    config: OperatorConfig,
    store: metastore.MetaStoreEndpoint,
) -> Pass:
    """The Pass, its desired status starting from what the status says (the timestamps kept)."""
    desired = JobStatus(
        phase=status.phase or Phase.PENDING,
        observed_generation=job.ref.generation,
        restarts=status.restarts,
        group_created=status.group_created,
        meta_store=MetaStoreStatus(mode=store.mode, address=store.address, secret_name=store.secret_name),
        start_time=status.start_time,
        last_restart_time=status.last_restart_time,
        completion_time=status.completion_time,
        suspension=status.suspension,
    )
    return Pass(job, status, observed, now, config, desired)


@dataclass(frozen=True)
class _Children:
    """The children this pass creates, and what the meta-store's Secret says about the rest."""

    creates: list[dict[str, Any]]
    secret_ours: bool  # the Secret exists as this job's, or is created in this pass
    lost_secret: bool  # this job's Redis runs but its Secret is gone
    redis_restart: list[PodRef]  # then Redis restarts on the new Secret


def _children(
    p: Pass, current: list[PodState], store: metastore.MetaStoreEndpoint, password: str
) -> _Children:
    """The children that outlive pod groups (children.py) and are missing. A name another object holds is
    not created (and not counted as ours): it becomes a condition instead (readiness.names_taken)."""
    foreign = {f.key for f in p.observed.foreign}
    inputs = children.BuildInputs(
        password=password,
        gang_ready=ready_count(current) == p.n,
        worker_pod=lambda: pods.pod(p.job, 0, p.desired.restarts, store, p.config),
        workload_seen=p.observed.workload is not None,
        workload_priority=p.observed.workload_priority,
    )
    built = [child.build(inputs) for child in children.of(p.job, p.config)]
    creates = [
        m
        for m in built
        if m is not None and child_key(m) not in p.observed.children and child_key(m) not in foreign
    ]
    # Redis mounts the Secret and the pods read it by name: neither is created before this job's own Secret
    # exists or is created in this pass (first; the executor holds them back if that create is refused), so
    # a predecessor's Secret still being collected can never hand Redis and the pods different passwords.
    secret = children.secret_key(p.job)
    managed = store.mode == "Managed"
    creating_secret = any(child_key(m) == secret for m in creates)
    secret_ours = not managed or secret in p.observed.children or creating_secret
    if not secret_ours:
        creates = [m for m in creates if m["kind"] != "Deployment"]
    # This job's Redis runs but its Secret is gone: the new Secret carries a new password, which Redis reads
    # only at start and the pods only at creation. Restart both on it rather than leave them split.
    lost_secret = managed and children.deployment_key(p.job) in p.observed.children and creating_secret
    if any(m["kind"] == "Deployment" for m in creates):
        p.event(
            "Normal", Reason.CREATED_META_STORE, f"Created Redis meta-store {names.metastore(p.job.ref.name)}"
        )
    redis_restart = [PodRef(name, uid) for name, uid in p.observed.metastore_pods] if lost_secret else []
    return _Children(creates, secret_ours, lost_secret, redis_restart)


def _suspend(p: Pass, kids: _Children) -> Plan:
    """The user's spec.suspend, the operator's on a rollout breach, or Kueue's eviction (suspension.py). A
    Secret lost meanwhile is made anew and Redis restarts on it here too: said as when running."""
    if kids.lost_secret:
        p.event("Warning", Reason.META_STORE_PASSWORD_CHANGED, _password_changed(p))
    if p.job.spec.suspend and rollout_breach(p.job, dict(p.status.raw), "SuspendAtStepBoundary"):
        p.suspended_by = Reason.ROLLOUT_INCONSISTENT  # the operator set spec.suspend (rollout_check.py)
    return suspension.suspend(p, kids.creates, kids.redis_restart)


def _resume(p: Pass) -> None:
    """Not suspended (any more): say so, and withdraw a suspend's checkpoint request before pods exist."""
    p.condition(Cond.SUSPENDED, False, Reason.NOT_SUSPENDED)
    if p.phase == Phase.SUSPENDED and not p.observed.checkpoint_write_error:  # once, not per withdraw retried
        p.event("Normal", Reason.RESUMED, f"Resumed: recreating {p.n} pods")
    suspension.withdraw_checkpoint_request(p)


@dataclass(frozen=True)
class _FinalRecord:
    """Once the trainer recorded its final step the training is done: whatever the pods do next (exit 0,
    fail, vanish) ends the job, never restarts it. The step follower's own answer (`observed.final_record`)
    may be ahead of status (a restarted operator replays the stream; a status write can be backing off); a
    trainer container's termination message holds the record even when the stream lost it."""

    recorded: bool
    failure: str | None  # the trainer's message when its final record says the training failed
    active: list[PodState]  # pods still running the training
    stop_engines: list[PodRef]  # pods whose trainer is done: their SGLang never exits by itself

    @classmethod
    def of(cls, p: Pass, current: list[PodState]) -> _FinalRecord:
        observed = p.observed
        recorded = p.status.final_step_recorded or observed.final_record is True
        recorded = recorded or any(pod.final_message for pod in current)
        active = [pod for pod in current if pod.phase not in FINISHED and not pod.deleting]
        # After the final record a pod whose trainer exited is done; the job ends now and deletes such pods
        # (their GPUs go back), rather than waiting on the engine.
        engines_left = [pod for pod in active if recorded and pod.trainer_exited]
        # The stream's word wins over a termination message: one rank's failure fails the run.
        failure = p.status.final_failure or (observed.final_failure if observed.final_record else None)
        return cls(
            recorded,
            failure,
            [pod for pod in active if pod not in engines_left],
            [PodRef.of(pod) for pod in engines_left],
        )


def _final(p: Pass, group: Group, final: _FinalRecord, kids: _Children) -> Plan | None:
    """The job ends once the final record is in and no pod runs the training. A failed final record
    (`finish(ok=False)`) ends it Failed with the trainer's message, never restarted; it (and its Kueue
    Workload) never ends Succeeded."""
    if not final.recorded or not (group.current or p.desired.group_created) or final.active:
        return None
    if final.failure:
        message = f"the trainer's final record says the training failed: {final.failure}"
        return transitions.fail(p, Reason.TRAINING_FAILED, message, kids.creates)  # engines_left among them
    return transitions.succeed(p, group.current, kids.creates, final.stop_engines)


def _password_changed(p: Pass) -> str:
    return (
        f"Secret {names.metastore_secret(p.job.ref.name)} was deleted: it is created again with a new "
        "password, and Redis and the pods restart on it"
    )


def _lost_secret(p: Pass, group: Group, kids: _Children) -> Plan | None:
    """The Secret was deleted while Redis ran: a new password, so Redis and the group restart on it."""
    if not kids.lost_secret:
        return None
    message = _password_changed(p)
    p.event("Warning", Reason.META_STORE_PASSWORD_CHANGED, message)
    ran = bool(group.current or p.desired.group_created)
    limit = p.job.spec.run_policy.max_restarts
    if ran and p.desired.restarts >= limit:
        failed = transitions.fail(
            p, Reason.MAX_RESTARTS_EXCEEDED, f"{message}; all {limit} restarts used", kids.creates
        )
        return replace(failed, deletes=failed.deletes + tuple(kids.redis_restart))
    if ran:
        return transitions.restart(
            p, Reason.META_STORE_PASSWORD_CHANGED, message, kids.creates, kids.redis_restart
        )
    return p.plan(creates=kids.creates, deletes=kids.redis_restart, requeue_after=SOON)


def _waiting_for_final(p: Pass, group: Group, final: _FinalRecord) -> PodState | None:
    """A pod exited and the step follower is still reading the stream for the final record: the first such
    pod, whose exit is not judged yet."""
    exits = [pod for pod in group.current if pod.phase in FINISHED]
    return exits[0] if exits and not final.recorded and p.observed.final_record_pending else None


def _failure(p: Pass, group: Group, final: _FinalRecord, kids: _Children) -> Plan | None:
    """A group failure (a pod failed, exited, vanished; SGLang crash-looped; placement timed out): restart
    the group, or fail the job once the restarts are used."""
    judged = not final.recorded and _waiting_for_final(p, group, final) is None
    cause = group_failure(p.job, group.current, p.desired.group_created) if judged else None
    cause = cause or placement_timeout(p, group.current, p.desired.group_created)
    if cause is None:
        return None
    reason, message = cause
    if reason == Reason.POD_EXITED_WITHOUT_FINAL_STEP and p.observed.final_record is None:
        message += " (the step stream could not be read to its end to confirm)"
    return transitions.restart_or_fail(p, reason, message, kids.creates)


@dataclass(frozen=True)
class _Running:
    """What the last step needs of the earlier ones."""

    group: Group
    kids: _Children
    store: metastore.MetaStoreEndpoint
    kueue_hold: bool
    name_taken: str
    meta_ready: bool
    engine_back_soon: bool


def _run(p: Pass, final: _FinalRecord, r: _Running) -> Plan:
    """No failure: finish a restart or a resume (old pods gone, backoff over), create what is missing, and
    say where the job stands."""
    current = r.group.current
    override, requeue, creates = _pods_override(p, final, r)
    if r.name_taken and not _metastore_taken(p, r.store):
        # Said on PodsReady whatever else is pending (the Event is posted once per NameTaken spell).
        override = Condition(Cond.PODS_READY, False, Reason.NAME_TAKEN, f"pods are held up: {r.name_taken}")
        requeue = min_delay(requeue, NAME_TAKEN_RECHECK)
    ready = readiness.pods_ready(p, current, override)
    readiness.resources_allocated(p, current)
    _phase(p, ready and r.meta_ready and p.desired.group_created, r.engine_back_soon)
    deletes = live_refs(r.group.stale)
    if deletes:
        requeue = min_delay(requeue, SOON)
    limit = deadline(p)
    if limit is not None:  # wake up when the deadline passes, not at the next resync
        requeue = min_delay(requeue, (limit[1] + timedelta(seconds=limit[0]) - p.now).total_seconds())
    placement = placement_deadline(p, current, p.desired.group_created)
    if placement is not None:
        requeue = min_delay(requeue, (placement - p.now).total_seconds())
    return p.plan(creates=r.kids.creates + creates, deletes=deletes, requeue_after=requeue)


def _pods_override(
    p: Pass, final: _FinalRecord, r: _Running
) -> tuple[Condition | None, float | None, list[dict[str, Any]]]:
    """PodsReady's word when the pods are held up, when to look again, and the pods created."""
    exited = _waiting_for_final(p, r.group, final)
    if exited is not None:
        message = (
            f"{exited.describe()}; reading the step stream for the trainer's final record before treating "
            "the exit as a failure"
        )
        return Condition(Cond.PODS_READY, False, Reason.WAITING_FOR_FINAL_RECORD, message), SOON, []
    if p.desired.group_created:
        return None, None, []
    inputs = GateInputs(
        r.group.current, r.group.stale, r.store, r.kueue_hold, r.name_taken, r.kids.secret_ours
    )
    decided = gate(p, inputs)
    return decided.condition, min_delay(decided.requeue), decided.creates


def _metastore_taken(p: Pass, store: metastore.MetaStoreEndpoint) -> bool:
    """Some of the Managed meta-store's names are held by others (MetaStoreReady says so already)."""
    return store.mode == "Managed" and any(
        f.key in children.metastore_keys(p.job) for f in p.observed.foreign
    )


def _phase(p: Pass, running: bool, engine_back_soon: bool) -> None:
    restarts = p.desired.restarts
    restarting = _is_true(p, Cond.RESTARTING)
    if running:
        p.set(phase=Phase.RUNNING)
        if restarting:
            p.condition(Cond.RESTARTING, False, Reason.GROUP_RUNNING, f"group restart {restarts} is running")
        if p.phase != Phase.RUNNING:
            p.event("Normal", Reason.JOB_RUNNING, f"All {p.n} pods are ready (group restart {restarts})")
        return
    p.set(phase=Phase.RESTARTING if restarting else Phase.PENDING)
    if engine_back_soon and p.phase == Phase.RUNNING and not restarting:
        p.set(phase=Phase.RUNNING)  # the trainer runs on while SGLang restarts in place


def _is_true(p: Pass, type_: str) -> bool:
    found = p.status.condition(type_)
    return bool(found and found.get("status") == "True")
