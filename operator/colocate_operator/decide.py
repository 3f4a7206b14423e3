"""The reconcile decision: (job, its status, what exists, now) -> a Plan. Pure; no API calls, no clock.

Level-based: the plan depends only on the current state, so running it twice, or after a crash half-way
through the previous one, converges. The only state kept between passes is in the job's status:
`restarts` (the group incarnation; pods carry it as a label), `groupCreated` (whether a missing pod is a
failure or just not created yet), and the timestamps. Transitions that delete pods (restart, fail, suspend)
are persisted before the deletion (`persist_first`), so a crash between the two repeats the deletion, never
the transition.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from colocate_operator import conditions, disruption, gang, gpus, kueue, metastore, names, pods, steps
from colocate_operator.conditions import Condition
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import IPC_PREFLIGHT_FAILURES, ROLLOUT_BREACHES, Cond, Phase, Reason
from colocate_operator.observed import ClaimState, CreateRefusal, Observed, PodState, child_key
from colocate_operator.spec import ColocateJob
from colocate_operator.status import final_failure, final_step_recorded

SOON = 1.0  # seconds: re-check after creating or deleting, when no watch event may come
NAME_TAKEN_RECHECK = 10.0  # a child name held by someone else: look again now and then, not at 1 Hz
FINISHED = ("Succeeded", "Failed")
# A create the API server refused (a quota, an admission policy) is tried again after 5 s, then 10, 20, ...
# at most every 5 minutes, until one of that kind succeeds (issue 30, item 6).
CREATE_BACKOFF_SECONDS = 5.0
CREATE_BACKOFF_CAP_SECONDS = 300.0


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str


@dataclass(frozen=True)
class CheckpointWrite:
    """What a suspend writes into the job's meta-store (checkpoints.py), after any persist-first status write
    and before anything else: a checkpoint request, or on resume the request withdrawn and the resume step
    put back if the store lost it (contract/checkpoint.py)."""

    request_id: str | None = None
    reason: str = ""
    withdraw: bool = False
    resume_step: int | None = None


@dataclass(frozen=True)
class Plan:
    status: dict[str, Any]
    creates: tuple[dict[str, Any], ...] = ()
    deletes: tuple[PodRef, ...] = ()
    force_deletes: tuple[PodRef, ...] = ()  # grace 0: pods whose node stopped answering
    persist_first: bool = False
    delete_job: bool = False
    events: tuple[EventSpec, ...] = ()
    requeue_after: float | None = None
    checkpoint: CheckpointWrite | None = None


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def restart_delay(restarts: int, base_seconds: float, cap_seconds: float) -> float:
    """Backoff before creating group incarnation `restarts`: base, 2*base, 4*base, ... capped."""
    if restarts <= 0 or base_seconds <= 0:
        return 0.0
    return float(min(cap_seconds, base_seconds * 2 ** min(restarts - 1, 30)))


def create_backoff(attempts: int) -> float:
    """Seconds to wait after `attempts` refused creates in a row: 5, 10, 20, ... capped at 300."""
    if attempts <= 0:
        return 0.0
    return float(min(CREATE_BACKOFF_CAP_SECONDS, CREATE_BACKOFF_SECONDS * 2 ** min(attempts - 1, 30)))


def create_retry_at(refusal: CreateRefusal) -> datetime:
    return refusal.at + timedelta(seconds=create_backoff(refusal.attempts))


def _refusal(p: _Pass, kind: str) -> CreateRefusal | None:
    return next((r for r in p.observed.create_refusals if r.kind == kind), None)


def _refusal_message(refusal: CreateRefusal) -> str:
    times = "once" if refusal.attempts == 1 else f"{refusal.attempts} times in a row"
    return (
        f"the API server refused creating {refusal.kind.lower()} {refusal.name} ({times}; next attempt at "
        f"{conditions.timestamp(create_retry_at(refusal))}): {refusal.message}"
    )


def _min_delay(*delays: float | None) -> float | None:
    present = [d for d in delays if d is not None]
    return max(0.0, min(present)) if present else None


@dataclass
class _Pass:
    """Working state of one decision; turned into a Plan at the end."""

    job: ColocateJob
    status: dict[str, Any]
    observed: Observed
    now: datetime
    updates: list[Condition] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    force_deletes: list[PodRef] = field(default_factory=list)
    wake: float | None = None  # seconds until a stuck pod is due for a forced deletion
    checkpoint: CheckpointWrite | None = None
    suspended_by: str = Reason.SUSPENDED_BY_USER  # or Kueue's eviction (_kueue_admission)

    @property
    def n(self) -> int:
        return self.job.spec.num_nodes

    def condition(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.updates.append(Condition(type_, status, reason, message))

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(EventSpec(type_, reason, message))

    def previous_reason(self, type_: str) -> str | None:
        found = conditions.find(self.status.get("conditions") or [], type_)
        return found.get("reason") if found else None


def decide(
    job: ColocateJob,
    status: dict[str, Any],
    observed: Observed,
    now: datetime,
    config: OperatorConfig,
    password: str,
) -> Plan:
    """`password` is used only if the meta-store Secret has to be created (the caller draws a fresh one)."""
    p = _Pass(job, status, observed, now)
    spec = job.spec
    restarts = int(status.get("restarts") or 0)
    phase = status.get("phase") or Phase.PENDING
    store = metastore.endpoint(job, config)
    new: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": job.ref.generation,
        "restarts": restarts,
        "groupCreated": bool(status.get("groupCreated")),
        "metaStore": store.status(),
    }
    for key in ("startTime", "lastRestartTime", "completionTime", "suspension"):
        if status.get(key):
            new[key] = status[key]

    current = sorted(
        (
            pod
            for pod in observed.pods
            if pod.owned and pod.restart == restarts and pod.index is not None and 0 <= pod.index < p.n
        ),
        key=lambda pod: pod.index or 0,
    )
    stale = [pod for pod in observed.pods if pod not in current]
    _replica_status(p, new, current)
    engine_back_soon = _engine_restarts(p, new, current)
    _force_delete_stuck(p, config)

    if phase in Phase.TERMINAL:
        return _terminal(p, new, config)

    # Children that outlive pod groups: meta-store, claim template, headless Service. A name another object
    # holds is not created (and not counted as ours): it becomes a condition instead. The budget guards a
    # whole gang, so it is created once every pod of the group is ready (until then no eviction it could
    # refuse would cost more than a bring-up, and the disruption controller would rewrite its status as each
    # pod comes up); it then stays through group restarts.
    foreign = {f.key for f in observed.foreign}
    infra = [
        *metastore.managed_children(job, config, password),
        gpus.claim_template(job),
        pods.headless_service(job),
        pods.network_policy(job),
        disruption.budget(job) if _ready_count(current) == p.n else None,
        _kueue_workload(p, restarts, store, config),
        *(gang.objects(job) if config.native_gang else ()),
    ]
    creates: list[dict[str, Any]] = [
        m
        for m in infra
        if m is not None and child_key(m) not in observed.children and child_key(m) not in foreign
    ]
    # Redis mounts the Secret and the pods read it by name: neither is created before this job's own Secret
    # exists or is created in this pass (first; the executor holds them back if that create is refused), so
    # a predecessor's Secret still being collected can never hand Redis and the pods different passwords.
    secret_key = f"Secret/{names.metastore_secret(job.ref.name)}"
    secret_ours = (
        store.mode != "Managed"
        or secret_key in observed.children
        or any(child_key(m) == secret_key for m in creates)
    )
    if not secret_ours:
        creates = [m for m in creates if m["kind"] != "Deployment"]
    # This job's Redis runs but its Secret is gone: the new Secret carries a new password, which Redis reads
    # only at start and the pods only at creation. Restart both on it rather than leave them split.
    lost_secret = (
        store.mode == "Managed"
        and f"Deployment/{names.metastore(job.ref.name)}" in observed.children
        and any(child_key(m) == secret_key for m in creates)
    )
    if any(m["kind"] == "Deployment" for m in creates):
        p.event(
            "Normal", Reason.CREATED_META_STORE, f"Created Redis meta-store {names.metastore(job.ref.name)}"
        )
    name_taken = _name_taken_message(p)
    meta_taken = store.mode == "Managed" and any(f.key in _metastore_names(job) for f in observed.foreign)
    meta_ready = _metastore_condition(p, store)

    redis_restart = [PodRef(name, uid) for name, uid in observed.metastore_pods] if lost_secret else []
    # Kueue: no pods before its admission (hold); its eviction stops them through the suspend path.
    kueue_stop, kueue_hold = _kueue_admission(p, current, new, phase)
    if spec.suspend or kueue_stop:
        if spec.suspend and rollout_breach(job, status, "SuspendAtStepBoundary"):
            p.suspended_by = Reason.ROLLOUT_INCONSISTENT  # the operator set spec.suspend (rollout_check.py)
        return _suspend(p, new, phase, creates, redis_restart)
    start = parse_time(status.get("startTime"))
    deadline = spec.run_policy.active_deadline_seconds
    if deadline and start and now >= start + timedelta(seconds=deadline):
        return _fail(
            p,
            new,
            Reason.DEADLINE_EXCEEDED,
            f"the job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}",
            creates,
        )
    ipc_failure = ipc_preflight_failure(job, status)
    if ipc_failure is not None:
        return _fail(p, new, Reason.IPC_PREFLIGHT_FAILED, ipc_failure, creates)
    drift = rollout_breach(job, status, "Fail")
    if drift is not None:
        return _fail(p, new, Reason.ROLLOUT_INCONSISTENT, drift, creates)
    p.condition(Cond.SUSPENDED, False, Reason.NOT_SUSPENDED)
    if phase == Phase.SUSPENDED and not observed.checkpoint_write_error:  # once, not per withdraw retried
        p.event("Normal", Reason.RESUMED, f"Resumed: recreating {p.n} pods")
    _withdraw_checkpoint_request(p, phase)

    # Once the trainer recorded its final step the training is done: whatever the pods do next (exit 0, fail,
    # vanish) ends the job, never restarts it. `final_record` is the step follower's own answer, which may be
    # ahead of status (a restarted operator replays the stream; a status write can be backing off); a
    # trainer container's termination message holds the record even when the stream lost it.
    final_recorded = (
        final_step_recorded(status)
        or observed.final_record is True
        or any(pod.final_message for pod in current)
    )
    active = [pod for pod in current if pod.phase not in FINISHED and not pod.deleting]
    # After the final record a pod whose trainer exited is done; its SGLang container never exits by itself,
    # so the job ends now and deletes such pods (their GPUs go back), rather than waiting on the engine.
    engines_left = [pod for pod in active if final_recorded and pod.trainer_exited]
    active = [pod for pod in active if pod not in engines_left]
    stop_engines = [PodRef(pod.name, pod.uid) for pod in engines_left]
    # A final record can say the training failed (`finish(ok=False)`): the run is over all the same (never
    # restarted), and the job ends Failed with the trainer's message; it (and its Kueue Workload) never
    # ends Succeeded. The stream's word wins over a termination message: one rank's failure fails the run.
    trainer_failure = final_failure(status) or (observed.final_failure if observed.final_record else None)
    if final_recorded and trainer_failure and (current or new["groupCreated"]) and not active:
        return _fail(  # deletes the pods still running, engines_left among them
            p,
            new,
            Reason.TRAINING_FAILED,
            f"the trainer's final record says the training failed: {trainer_failure}",
            creates,
        )
    if final_recorded and (current or new["groupCreated"]) and not active:
        new.update(phase=Phase.SUCCEEDED, completionTime=conditions.timestamp(now))
        failed_after = [pod.describe() for pod in current if pod.phase == "Failed"]
        message = "the trainer recorded its final step" + (
            f"; after it, {'; '.join(failed_after)}" if failed_after else ""
        )
        p.condition(Cond.SUCCEEDED, True, Reason.FINAL_STEP_RECORDED, message)
        p.event("Normal", Reason.JOB_SUCCEEDED, "All pods finished after the trainer recorded its final step")
        return _plan(p, new, creates=creates, deletes=stop_engines, persist_first=True)

    if lost_secret:
        message = (
            f"Secret {names.metastore_secret(job.ref.name)} was deleted: it is created again with a new "
            "password, and Redis and the pods restart on it"
        )
        p.event("Warning", Reason.META_STORE_PASSWORD_CHANGED, message)
        if (current or new["groupCreated"]) and restarts >= spec.run_policy.max_restarts:
            limit = spec.run_policy.max_restarts
            fail = _fail(
                p, new, Reason.MAX_RESTARTS_EXCEEDED, f"{message}; all {limit} restarts used", creates
            )
            return replace(fail, deletes=fail.deletes + tuple(redis_restart))
        if current or new["groupCreated"]:
            return _restart(
                p, new, Reason.META_STORE_PASSWORD_CHANGED, message, creates, config, redis_restart
            )
        return _plan(p, new, creates=creates, deletes=redis_restart, requeue_after=SOON)

    privileged = pods.privileged_fields(spec)
    exits = [pod for pod in current if pod.phase in FINISHED]
    waiting_for_final = bool(exits) and not final_recorded and observed.final_record_pending
    cause = None if final_recorded or waiting_for_final else _group_failure(job, current, new["groupCreated"])
    if cause is None:
        cause = _placement_timeout(p, current, new["groupCreated"])
    if cause is not None:
        reason, message = cause
        if reason == Reason.POD_EXITED_WITHOUT_FINAL_STEP and observed.final_record is None:
            message += " (the step stream could not be read to its end to confirm)"
        if restarts >= spec.run_policy.max_restarts:
            return _fail(
                p,
                new,
                Reason.MAX_RESTARTS_EXCEEDED,
                f"{message}; all {spec.run_policy.max_restarts} restarts used",
                creates,
            )
        return _restart(p, new, reason, message, creates, config)

    # No failure: finish a restart or a resume (old pods gone, backoff over), then create what is missing.
    deletes = [PodRef(pod.name, pod.uid) for pod in stale if not pod.deleting]
    requeue: float | None = None
    pods_condition: Condition | None = None
    if waiting_for_final:
        pods_condition = Condition(
            Cond.PODS_READY,
            False,
            Reason.WAITING_FOR_FINAL_RECORD,
            f"{exits[0].describe()}; reading the step stream for the trainer's final record before "
            "treating the exit as a failure",
        )
        requeue = _min_delay(requeue, SOON)
    elif not new["groupCreated"]:
        present = {pod.index for pod in current if not pod.deleting}
        delay = restart_delay(restarts, spec.run_policy.backoff_seconds, config.max_backoff_seconds)
        ready_at = (parse_time(status.get("lastRestartTime")) or now) + timedelta(seconds=delay)
        if stale or len(present) < len(current):
            pods_condition = Condition(
                Cond.PODS_READY,
                False,
                Reason.WAITING_FOR_OLD_PODS,
                _old_pods_message(p, stale, current, config),
            )
            requeue = _min_delay(requeue, SOON)
        elif len(present) == p.n:
            new["groupCreated"] = True
        elif now < ready_at:
            pods_condition = Condition(
                Cond.PODS_READY,
                False,
                Reason.WAITING_FOR_BACKOFF,
                f"restart {restarts} creates pods at {conditions.timestamp(ready_at)}"
                + _backoff_capped(job, config),
            )
            requeue = _min_delay(requeue, (ready_at - now).total_seconds())
        elif gpus.uses_dra(job) and observed.device_class_found is False:
            pass  # reported by ResourcesAllocated below; pods would only sit unschedulable
        elif kueue_hold:
            pods_condition = Condition(
                Cond.PODS_READY, False, Reason.QUEUED_BY_KUEUE, "pods are created once Kueue admits the job"
            )
        elif not store.allowed:
            pass  # reported by MetaStoreReady: the pods would send the password to a refused address
        elif privileged and not config.allows_privileged(job.ref.namespace):
            message = (
                f"pods are not created: {', '.join(privileged)} ask for privileges Pod Security "
                f"restricted refuses, and namespace {job.ref.namespace} is not among the operator's "
                "privileged namespaces (chart value security.allowPrivilegedNamespaces, "
                "--allow-privileged-namespace)"
            )
            pods_condition = Condition(Cond.PODS_READY, False, Reason.PRIVILEGED_NOT_ALLOWED, message)
            if p.previous_reason(Cond.PODS_READY) != Reason.PRIVILEGED_NOT_ALLOWED:
                p.event("Warning", Reason.PRIVILEGED_NOT_ALLOWED, message)
        elif name_taken or not secret_ours:
            # The pods would dial (and send the password to) whatever holds the meta-store's names.
            pods_condition = Condition(
                Cond.PODS_READY, False, Reason.NAME_TAKEN, f"pods are not created: {name_taken}"
            )
            requeue = _min_delay(requeue, NAME_TAKEN_RECHECK)
        elif (refusal := _refusal(p, "Pod")) is not None and now < create_retry_at(refusal):
            # Refused by admission (a quota, a policy): not again before the backoff ends, whatever pass.
            pods_condition = Condition(
                Cond.PODS_READY, False, Reason.CREATE_REFUSED, _refusal_message(refusal)
            )
            requeue = _min_delay(requeue, (create_retry_at(refusal) - now).total_seconds())
        else:
            if refusal is not None:  # trying again: the condition keeps the server's words meanwhile
                pods_condition = Condition(
                    Cond.PODS_READY, False, Reason.CREATE_REFUSED, _refusal_message(refusal)
                )
            store_pods = [
                kueue.place(pods.pod(job, i, restarts, store, config), observed.workload_placement)
                for i in range(p.n)
                if i not in present
            ]
            creates.extend(store_pods)
            new.setdefault("startTime", conditions.timestamp(now))
            p.event(
                "Normal",
                Reason.CREATED_PODS,
                f"Creating pods {', '.join(m['metadata']['name'] for m in store_pods)} "
                f"(group restart {restarts})",
            )
            requeue = SOON

    if name_taken and not meta_taken:
        # Said on PodsReady whatever else is pending (the Event is posted once per NameTaken spell).
        pods_condition = Condition(
            Cond.PODS_READY, False, Reason.NAME_TAKEN, f"pods are held up: {name_taken}"
        )
        requeue = _min_delay(requeue, NAME_TAKEN_RECHECK)
    ready = _pods_condition(p, current, pods_condition)
    _resources_condition(p, current)
    running = ready and meta_ready and bool(new["groupCreated"])
    restarting = conditions.is_true(status.get("conditions") or [], Cond.RESTARTING)
    if running:
        new["phase"] = Phase.RUNNING
        if restarting:
            p.condition(Cond.RESTARTING, False, Reason.GROUP_RUNNING, f"group restart {restarts} is running")
        if phase != Phase.RUNNING:
            p.event("Normal", Reason.JOB_RUNNING, f"All {p.n} pods are ready (group restart {restarts})")
    else:
        new["phase"] = Phase.RESTARTING if restarting else Phase.PENDING
        if engine_back_soon and phase == Phase.RUNNING and not restarting:
            new["phase"] = Phase.RUNNING  # the trainer runs on while SGLang restarts in place
    if deletes:
        requeue = _min_delay(requeue, SOON)
    if deadline and start:  # wake up when the deadline passes, not at the next resync
        requeue = _min_delay(requeue, (start + timedelta(seconds=deadline) - now).total_seconds())
    placement = _placement_deadline(p, current, new["groupCreated"])
    if placement is not None:
        requeue = _min_delay(requeue, (placement - now).total_seconds())
    return _plan(p, new, creates=creates, deletes=deletes, requeue_after=requeue)


def _name_taken_message(p: _Pass) -> str:
    """Objects holding the job's child names that are not the job's: a condition (and one Event when it
    starts) naming them, never silent success and never a create retried every second."""
    foreign = p.observed.foreign
    if not foreign:
        return ""
    ns = p.job.ref.namespace
    message = "; ".join(f.describe(ns) for f in foreign) + (
        ": delete or rename it, or rename this job" if len(foreign) == 1 else ": delete or rename them"
    )
    previous = (p.previous_reason(Cond.PODS_READY), p.previous_reason(Cond.META_STORE_READY))
    if Reason.NAME_TAKEN not in previous:
        p.event("Warning", Reason.NAME_TAKEN, message)
    return message


def _metastore_names(job: ColocateJob) -> set[str]:
    name = names.metastore(job.ref.name)
    return {
        f"Secret/{names.metastore_secret(job.ref.name)}",
        f"Deployment/{name}",
        f"Service/{name}",
        f"NetworkPolicy/{name}",
    }


def _force_delete_stuck(p: _Pass, config: OperatorConfig) -> None:
    """Pods still Terminating `force_delete_after_seconds` past their grace period sit on a node whose
    kubelet no longer answers; with fixed pod names they would block the group restart forever. They are
    deleted with grace 0 (the plan wakes up when the next one is due)."""
    grace = timedelta(seconds=config.force_delete_after_seconds)
    for pod in p.observed.pods:
        if not pod.deleting or pod.delete_by is None:
            continue
        due = pod.delete_by + grace
        if p.now < due:
            p.wake = _min_delay(p.wake, (due - p.now).total_seconds())
            continue
        p.force_deletes.append(PodRef(pod.name, pod.uid))
        late = int((p.now - pod.delete_by).total_seconds())
        where = f" on node {pod.node}" if pod.node else ""
        p.event(
            "Warning",
            Reason.FORCE_DELETED_POD,
            f"pod {pod.name}{where} was still terminating {late} s after its grace period ended (its node "
            "does not confirm the deletion): deleted with grace period 0",
        )


def _old_pods_message(
    p: _Pass, stale: list[PodState], current: list[PodState], config: OperatorConfig
) -> str:
    waiting = [pod for pod in (*stale, *current) if pod.deleting or pod in stale]
    message = f"waiting for {len(waiting)} old pods to terminate"
    late = [pod for pod in waiting if pod.deleting and pod.delete_by is not None and p.now > pod.delete_by]
    if late:
        pod = late[0]
        due = pod.delete_by + timedelta(seconds=config.force_delete_after_seconds)  # type: ignore[operator]
        message += (
            f"; pod {pod.name}{f' on node {pod.node}' if pod.node else ''} is past its grace period and is "
            f"deleted with grace period 0 at {conditions.timestamp(max(due, p.now))}"
        )
    return message


def _backoff_capped(job: ColocateJob, config: OperatorConfig) -> str:
    asked = job.spec.run_policy.backoff_seconds
    if asked <= config.max_backoff_seconds:
        return ""
    return (
        f" (spec.runPolicy.backoffSeconds={asked} is above the operator's cap of "
        f"{config.max_backoff_seconds:.0f} s, so the cap applies)"
    )


def _unplaced(current: list[PodState]) -> list[PodState]:
    return [pod for pod in current if not pod.scheduled and pod.phase == "Pending" and not pod.deleting]


def _placement_deadline(p: _Pass, current: list[PodState], group_created: bool) -> datetime | None:
    """When a partly placed group must give its GPUs back: the placed pods hold GPUs the unplaced ones wait
    for, and maybe the other way round in another job (two half-placed gangs never finish)."""
    unplaced = _unplaced(current)
    if not group_created or not unplaced or len(unplaced) == len(current):
        return None
    created = [pod.created for pod in current if pod.created is not None]
    if not created:
        return None
    return max(created) + timedelta(seconds=p.job.spec.scheduling.placement_timeout_seconds)


def _placement_timeout(p: _Pass, current: list[PodState], group_created: bool) -> tuple[str, str] | None:
    deadline = _placement_deadline(p, current, group_created)
    if deadline is None or p.now < deadline:
        return None
    unplaced = _unplaced(current)
    timeout = p.job.spec.scheduling.placement_timeout_seconds
    return (
        Reason.PLACEMENT_TIMEOUT,
        f"only {len(current) - len(unplaced)}/{p.n} pods were placed within "
        f"spec.scheduling.placementTimeoutSeconds={timeout}, so the placed ones give their GPUs back; "
        f"{_unschedulable_detail(unplaced)}",
    )


def _unschedulable_detail(unplaced: list[PodState]) -> str:
    pod = unplaced[0]
    more = f" (and {len(unplaced) - 1} more)" if len(unplaced) > 1 else ""
    return f"pod {pod.name}{more}: {pod.unschedulable or 'not scheduled yet'}"


def ipc_preflight_failure(job: ColocateJob, status: dict[str, Any]) -> str | None:
    """Why a job whose spec says `ipcPreflight.mode: Fail` fails: IPCReady (written by the step consumer) is
    False with a failure reason. Pending (PreflightPending) is no failure; Wait and Off never fail here."""
    if job.spec.weight_sync.ipc_preflight.mode != "Fail":
        return None
    found = conditions.find(status.get("conditions") or [], Cond.IPC_READY)
    if not found or found.get("status") != "False" or found.get("reason") not in IPC_PREFLIGHT_FAILURES:
        return None
    return f"IPC preflight failed ({found.get('reason')}): {found.get('message') or 'no detail'}"


def rollout_breach(job: ColocateJob, status: dict[str, Any], action: str) -> str | None:
    """What breached, when spec.weightSync.rolloutConsistency.action is `action` and RolloutConsistent (the
    step consumer's) says the last rollout report breached; else None. The message names the step and KL."""
    if job.spec.weight_sync.rollout_consistency.action != action:
        return None
    found = conditions.find(status.get("conditions") or [], Cond.ROLLOUT_CONSISTENT)
    if not found or found.get("status") != "False" or found.get("reason") not in ROLLOUT_BREACHES:
        return None
    return f"the engine's log-probs drifted from the trainer's: {found.get('message') or found.get('reason')}"


def _engine_restarts(p: _Pass, new: dict[str, Any], current: list[PodState]) -> bool:
    """Count SGLang's in-place restarts (the kubelet's restartCount of the rollout container) into
    status.engineRestarts, and say on EngineRecovered whether it serves again. Such a restart is no group
    restart: the trainer runs on and re-pushes its weights to the new engine (runtime/colocated/repush.py),
    and runPolicy.maxRestarts is not spent. Returns whether an engine is coming back right now.

    engineRestartsCounted holds the current group's restarts already counted: a count below it means new
    pods (a resume), counted from zero."""
    total = int(p.status.get("engineRestarts") or 0)
    counted = int(p.status.get("engineRestartsCounted") or 0)
    seen = sum(pod.engine_restarts for pod in current)
    fresh = seen if seen < counted else seen - counted
    if fresh:
        total += fresh
        restarted = [pod for pod in current if pod.engine_restarts]
        codes = sorted(
            {pod.engine_last_exit_code for pod in restarted if pod.engine_last_exit_code is not None}
        )
        p.event(
            "Warning",
            Reason.ENGINE_RESTARTED,
            f"SGLang restarted in place in pod{'s' if len(restarted) > 1 else ''} "
            f"{', '.join(pod.name for pod in restarted)}"
            + (f" (exit code {', '.join(map(str, codes))})" if codes else "")
            + "; the trainer keeps running and re-pushes its weights; no group restart",
        )
    if total or "engineRestarts" in p.status:
        new["engineRestarts"] = total
    if seen or "engineRestartsCounted" in p.status:
        new["engineRestartsCounted"] = seen
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


def _group_failure(job: ColocateJob, current: list[PodState], group_created: bool) -> tuple[str, str] | None:
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


def _ready_count(current: list[PodState]) -> int:
    return sum(1 for pod in current if pod.ready and pod.phase == "Running")


def _replica_status(p: _Pass, new: dict[str, Any], current: list[PodState]) -> None:
    ready = _ready_count(current)
    new["replicas"] = {
        "desired": p.n,
        "created": len(current),
        "scheduled": sum(1 for pod in current if pod.scheduled),
        "running": sum(1 for pod in current if pod.phase == "Running"),
        "ready": ready,
        "failed": sum(1 for pod in current if pod.phase == "Failed"),
    }
    new["ready"] = f"{ready}/{p.n}"
    claims = []
    for pod in current:
        if pod.claim:
            state = p.observed.claims.get(pod.claim) or ClaimState(pod.claim, False)
            claims.append(
                {
                    "pod": pod.name,
                    "claim": pod.claim,
                    "allocated": state.allocated,
                    "devices": list(state.devices),
                }
            )
    new["resourceClaims"] = claims


def _metastore_condition(p: _Pass, store: metastore.MetaStoreEndpoint) -> bool:
    taken = [f for f in p.observed.foreign if f.key in _metastore_names(p.job)]
    if store.mode == "Managed" and taken:
        ns = p.job.ref.namespace
        p.condition(
            Cond.META_STORE_READY,
            False,
            Reason.NAME_TAKEN,
            "; ".join(f.describe(ns) for f in taken) + ": this job's Redis is not created, nobody dials it",
        )
        return False
    if store.mode == "Managed":
        ready = p.observed.metastore_ready
        p.condition(
            Cond.META_STORE_READY,
            ready,
            Reason.REDIS_READY if ready else Reason.REDIS_STARTING,
            f"Redis at {store.address}" + ("" if ready else " is starting"),
        )
        return ready
    if not store.allowed:  # the operator reads no Secret and dials nothing for it; no pods either
        p.condition(Cond.META_STORE_READY, False, Reason.EXTERNAL_ADDRESS_NOT_ALLOWED, store.refusal())
        return False
    if p.observed.external_secret_found is False:
        p.condition(
            Cond.META_STORE_READY,
            False,
            Reason.SECRET_NOT_FOUND,
            f"secret {store.secret_name} with key {store.secret_key} not found",
        )
        return False
    p.condition(Cond.META_STORE_READY, True, Reason.EXTERNAL_CONFIGURED, f"external Redis at {store.address}")
    return True


def _pods_condition(p: _Pass, current: list[PodState], override: Condition | None) -> bool:
    ready = _ready_count(current)
    if override is not None:
        p.updates.append(override)
    elif ready == p.n:
        p.condition(Cond.PODS_READY, True, Reason.ALL_PODS_READY, f"{ready}/{p.n} pods ready")
    elif not current:
        p.condition(Cond.PODS_READY, False, Reason.PODS_NOT_CREATED, f"0/{p.n} pods created")
    else:
        unplaced = [pod for pod in _unplaced(current) if pod.unschedulable]
        detail = f"; {_unschedulable_detail(unplaced)}" if unplaced else ""
        p.condition(Cond.PODS_READY, False, Reason.PODS_PENDING, f"{ready}/{p.n} pods ready{detail}")
    return override is None and ready == p.n


def _resources_condition(p: _Pass, current: list[PodState]) -> None:
    job = p.job
    unplaced = [pod for pod in _unplaced(current) if pod.unschedulable]
    if unplaced and not (gpus.uses_dra(job) and p.observed.device_class_found is False):
        scheduled = sum(1 for pod in current if pod.scheduled)
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            False,
            Reason.UNSCHEDULABLE,
            f"{scheduled}/{p.n} pods scheduled; {_unschedulable_detail(unplaced)}",
        )
        return
    if not gpus.uses_dra(job):
        scheduled = sum(1 for pod in current if pod.scheduled)
        if current and scheduled == p.n:
            p.condition(
                Cond.RESOURCES_ALLOCATED,
                True,
                Reason.DEVICE_PLUGIN_FALLBACK,
                f"{scheduled}/{p.n} pods scheduled; GPUs from the device plugin (no DRA isolation)",
            )
        else:
            p.condition(
                Cond.RESOURCES_ALLOCATED,
                False,
                Reason.WAITING_FOR_SCHEDULING,
                f"{scheduled}/{p.n} pods scheduled",
            )
        return
    device_class = job.spec.gpu.device_class_name
    if p.observed.device_class_found is False:
        if p.previous_reason(Cond.RESOURCES_ALLOCATED) != Reason.DEVICE_CLASS_NOT_FOUND:
            p.event("Warning", Reason.DEVICE_CLASS_NOT_FOUND, f"DeviceClass {device_class} does not exist")
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            False,
            Reason.DEVICE_CLASS_NOT_FOUND,
            f"DeviceClass {device_class} does not exist; pods are not created",
        )
        return
    if not current:
        p.condition(Cond.RESOURCES_ALLOCATED, False, Reason.NO_PODS, "no pods, so no claims")
        return
    allocated = sum(
        1
        for pod in current
        if pod.claim and (p.observed.claims.get(pod.claim) or ClaimState("", False)).allocated
    )
    if allocated == p.n:
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            True,
            Reason.CLAIMS_ALLOCATED,
            f"{allocated}/{p.n} claims allocated, {job.spec.gpus_per_node} {device_class} devices each",
        )
    else:
        p.condition(
            Cond.RESOURCES_ALLOCATED, False, Reason.CLAIM_PENDING, f"{allocated}/{p.n} claims allocated"
        )


def _suspend(
    p: _Pass, new: dict[str, Any], phase: str, creates: list[dict[str, Any]], redis_restart: list[PodRef]
) -> Plan:
    if phase != Phase.SUSPENDED:
        waiting = _drain(p, new, phase, creates)
        if waiting is not None:
            return waiting
    deletes = [PodRef(pod.name, pod.uid) for pod in p.observed.pods if not pod.deleting] + redis_restart
    # Like a Job's: the active deadline counts from the (re)start, so a suspended job (a Kueue-preempted one,
    # say) does not fail DeadlineExceeded as soon as it resumes. Pod creation on resume sets it again.
    new.pop("startTime", None)
    new.update(phase=Phase.SUSPENDED, groupCreated=False)
    suspension = new.get("suspension") or {}
    message = f"{_stopped(suspension)}; meta-store, claim template and Services kept"
    p.condition(Cond.SUSPENDED, True, p.suspended_by, message)
    p.condition(Cond.PODS_READY, False, p.suspended_by, "suspended")
    p.condition(Cond.RESOURCES_ALLOCATED, False, p.suspended_by, "suspended")
    if conditions.find(p.status.get("conditions") or [], Cond.RESTARTING):
        p.condition(Cond.RESTARTING, False, p.suspended_by, "suspended")
    if phase != Phase.SUSPENDED:
        late = suspension.get("outcome") == "GracePeriodExpired"
        p.event(
            "Warning" if late else "Normal",
            p.suspended_by,
            f"Suspended: {_stopped(suspension)}; deleting {len(deletes)} pods",
        )
    return _plan(
        p,
        new,
        creates=creates,
        deletes=deletes,
        persist_first=phase != Phase.SUSPENDED,
        requeue_after=SOON if p.observed.pods else None,
    )


# status.weightSync.currentPhase while a step's weights are on their way (between the trainer's publish and
# its finished record); the step follower writes a phase change within its heartbeat (stepwatch.py).
SYNC_IN_FLIGHT = frozenset(
    steps.PHASE_NAMES[phase] for phase in ("published", "opened", "copied", "closed", "acked", "freed")
)
DRAIN_RECHECK = 2.0  # seconds between two looks at the checkpoint ACKs (each one a meta-store round trip)


def _drain(p: _Pass, new: dict[str, Any], phase: str, creates: list[dict[str, Any]]) -> Plan | None:
    """A suspend lets running pods end their step: the weight sync in flight finishes and every trainer rank
    that registered for checkpoint requests checkpoints and acknowledges, within the grace period. Returns
    the plan that waits, or None once the pods may go (`new["suspension"]` then says why and after which
    step)."""
    grace = p.job.spec.run_policy.suspend_grace_period_seconds
    sync = p.status.get("weightSync") or {}
    last_step = sync.get("lastCompletedStep")
    previous = p.status.get("suspension") or {}
    began = parse_time(previous.get("requestTime")) if phase == Phase.SUSPENDING else None
    began = began or p.now
    suspension: dict[str, Any] = {"requestTime": conditions.timestamp(began)}
    live = [pod for pod in p.observed.pods if pod.owned and not pod.deleting and pod.phase == "Running"]
    checkpoint = p.observed.checkpoint
    ranks = checkpoint.ranks if checkpoint is not None and checkpoint.readable else frozenset()
    request_id = suspension["requestTime"]
    acks = {
        rank: step
        for rank, (ack_id, step) in (checkpoint.acks.items() if checkpoint is not None else ())
        if rank in ranks and ack_id == request_id
    }
    in_flight = sync.get("currentPhase") in SYNC_IN_FLIGHT
    outcome: str | None = None
    if grace <= 0:
        outcome = "Immediate"
    elif ranks and len(acks) == len(ranks):
        outcome = "Checkpointed"  # also when a trainer exited right after its ACK
    elif not live:
        outcome = "NoRunningPods"
    elif not ranks and not in_flight and not (checkpoint is not None and checkpoint.pending):
        outcome = "SyncFinished"  # not while the first read of the records is on its way
    elif p.now >= began + timedelta(seconds=grace):
        outcome = "GracePeriodExpired"
    if ranks:
        suspension["checkpointRequested"] = True
    elif previous.get("checkpointRequested") and phase == Phase.SUSPENDING:
        suspension["checkpointRequested"] = True  # the store stopped answering after the request was written
    if outcome is not None:
        suspension["outcome"] = outcome
        if outcome == "Checkpointed":
            suspension["checkpointStep"] = min(acks.values())
            suspension["afterStep"] = max(min(acks.values()), last_step or 0)
        elif last_step is not None:
            suspension["afterStep"] = last_step
        new["suspension"] = suspension
        return None

    deadline = began + timedelta(seconds=grace)
    if ranks and checkpoint is not None and checkpoint.request_id != request_id:
        p.checkpoint = CheckpointWrite(request_id=request_id, reason=_suspend_reason(p))
    new["suspension"] = suspension
    new["phase"] = Phase.SUSPENDING
    if ranks:
        waiting = f"{len(acks)}/{len(ranks)} trainer ranks acknowledged the checkpoint request"
    else:
        where = f" (step {last_step + 1})" if last_step is not None else ""
        waiting = f"the weight sync in flight{where} is in phase {sync.get('currentPhase')}"
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
    if phase != Phase.SUSPENDING:
        p.event("Normal", Reason.SUSPENDING, f"Suspending: {message}")
    return _plan(
        p,
        new,
        creates=creates,
        persist_first=phase != Phase.SUSPENDING,  # the grace period's start, before the request is written
        requeue_after=min(DRAIN_RECHECK, max(0.0, (deadline - p.now).total_seconds())),
    )


def _suspend_reason(p: _Pass) -> str:
    by = "evicted by Kueue" if p.suspended_by == Reason.EVICTED_BY_KUEUE else "suspended (spec.suspend)"
    return f"ColocateJob {p.job.ref.namespace}/{p.job.ref.name} {by}"


def _stopped(suspension: dict[str, Any]) -> str:
    """Which step the pods stopped after and why then, from status.suspension (the same words every pass)."""
    after = suspension.get("afterStep")
    where = f"after step {after}" if after is not None else "before any step completed"
    outcome = suspension.get("outcome")
    why = {
        "Checkpointed": f"the trainer checkpointed after step {suspension.get('checkpointStep')}",
        "GracePeriodExpired": "the grace period ran out before the trainer acknowledged a checkpoint"
        if suspension.get("checkpointRequested")
        else "the grace period ran out before the weight sync in flight finished",
        "SyncFinished": "no weight sync in flight and no trainer registered for checkpoint requests",
        "NoRunningPods": "no pod was running",
        "Immediate": "spec.runPolicy.suspendGracePeriodSeconds is 0",
    }.get(outcome or "", "")
    return f"pods deleted {where}" + (f" ({why})" if why else "")


def _withdraw_checkpoint_request(p: _Pass, phase: str) -> None:
    """On resume (or a suspend called off while it waited): the request a new trainer must not see goes, and
    the resume step is put back if the store lost it, before any pod is created."""
    suspension = p.status.get("suspension") or {}
    if phase in (Phase.SUSPENDED, Phase.SUSPENDING) and suspension.get("checkpointRequested"):
        step = suspension.get("checkpointStep") if phase == Phase.SUSPENDED else None
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


def _restart(
    p: _Pass,
    new: dict[str, Any],
    reason: str,
    message: str,
    creates: list[dict[str, Any]],
    config: OperatorConfig,
    also_delete: list[PodRef] | None = None,
) -> Plan:
    restarts = int(new["restarts"]) + 1
    limit = p.job.spec.run_policy.max_restarts
    new.update(
        phase=Phase.RESTARTING,
        restarts=restarts,
        groupCreated=False,
        lastRestartTime=conditions.timestamp(p.now),
    )
    if new.get("engineRestartsCounted"):
        new["engineRestartsCounted"] = 0  # the new group's SGLang restarts count from zero
    detail = f"{message}; recreating all {p.n} pods (restart {restarts} of {limit})" + _backoff_capped(
        p.job, config
    )
    p.condition(Cond.RESTARTING, True, reason, detail)
    p.condition(Cond.PODS_READY, False, reason, message)
    p.event("Warning", Reason.RESTARTING_GROUP, detail)
    deletes = [PodRef(pod.name, pod.uid) for pod in p.observed.pods if not pod.deleting]
    deletes += also_delete or []
    return _plan(p, new, creates=creates, deletes=deletes, persist_first=True, requeue_after=SOON)


def _fail(p: _Pass, new: dict[str, Any], reason: str, message: str, creates: list[dict[str, Any]]) -> Plan:
    new.update(phase=Phase.FAILED, completionTime=conditions.timestamp(p.now), groupCreated=False)
    p.condition(Cond.FAILED, True, reason, message)
    p.condition(Cond.PODS_READY, False, reason, message)
    if conditions.find(p.status.get("conditions") or [], Cond.RESTARTING):
        p.condition(Cond.RESTARTING, False, reason, "the job failed")
    p.event("Warning", Reason.JOB_FAILED, f"{reason}: {message}")
    # Keep finished pods for their logs; delete the rest so the GPUs are free.
    deletes = [
        PodRef(pod.name, pod.uid)
        for pod in p.observed.pods
        if not pod.deleting and pod.phase not in ("Succeeded", "Failed")
    ]
    ttl = p.job.spec.run_policy.ttl_seconds_after_finished
    return _plan(
        p,
        new,
        creates=creates,
        deletes=deletes,
        persist_first=True,
        requeue_after=float(ttl) if ttl is not None else None,
    )


def _terminal(p: _Pass, new: dict[str, Any], config: OperatorConfig) -> Plan:
    deletes = [
        PodRef(pod.name, pod.uid)
        for pod in p.observed.pods
        if not pod.deleting and pod.phase not in ("Succeeded", "Failed")
    ]
    ttl = p.job.spec.run_policy.ttl_seconds_after_finished
    finished = parse_time(p.status.get("completionTime"))
    if ttl is not None and finished is not None:
        expires = finished + timedelta(seconds=ttl)
        if p.now >= expires:
            p.event("Normal", Reason.TTL_EXPIRED, f"Deleting the job {ttl}s after it finished")
            return _plan(p, new, deletes=deletes, delete_job=True)
        return _plan(p, new, deletes=deletes, requeue_after=(expires - p.now).total_seconds())
    return _plan(p, new, deletes=deletes, requeue_after=SOON if deletes else None)


def _plan(
    p: _Pass,
    new: dict[str, Any],
    *,
    creates: list[dict[str, Any]] | None = None,
    deletes: list[PodRef] | None = None,
    persist_first: bool = False,
    delete_job: bool = False,
    requeue_after: float | None = None,
) -> Plan:
    new["conditions"] = conditions.merge(
        list(p.status.get("conditions") or []), p.updates, p.now, p.job.ref.generation
    )
    # Children of a kind the API server refused wait for its backoff to end (pods: above, with a condition).
    held = {r.kind: create_retry_at(r) for r in p.observed.create_refusals if p.now < create_retry_at(r)}
    dropped = [held[m["kind"]] for m in creates or () if m["kind"] in held]
    if dropped:
        requeue_after = _min_delay(requeue_after, (min(dropped) - p.now).total_seconds())
    return Plan(
        status=new,
        creates=tuple(m for m in creates or () if m["kind"] not in held),
        deletes=tuple(deletes or ()),
        force_deletes=tuple(p.force_deletes),
        persist_first=persist_first,
        delete_job=delete_job,
        events=tuple(p.events),
        checkpoint=p.checkpoint,
        requeue_after=_min_delay(requeue_after, p.wake, SOON if p.force_deletes else None),
    )


def _kueue_workload(
    p: _Pass, restarts: int, store: metastore.MetaStoreEndpoint, config: OperatorConfig
) -> dict[str, Any] | None:
    """A queued job's Workload while it has none; its pod set's template is the worker pod itself."""
    if kueue.queue_name(p.job) is None or p.observed.workload is not None:
        return None
    worker = pods.pod(p.job, 0, restarts, store, config)
    return kueue.workload(p.job, worker, p.observed.workload_priority)


def _kueue_admission(p: _Pass, current: list[PodState], new: dict[str, Any], phase: str) -> tuple[bool, bool]:
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
    ran = bool(current or p.observed.pods or new["groupCreated"]) or phase not in (Phase.PENDING,)
    if ran:
        p.suspended_by = Reason.EVICTED_BY_KUEUE
    return ran, True
