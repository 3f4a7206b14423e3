"""Weight-update steps -> status: folds a job's step events (runtime/contract/events.py) into
`status.weightSync` and the bounded `status.recentSteps` history. Pure: no I/O, the clock is passed in.

A step is complete when every trainer GPU of the job reported `finished` with `result=ok` for it. Each
trainer process starts its own incarnation (`gen`), so incarnations are compared per GPU: events of an older
incarnation on the same GPU are stale, and a newer one drops that GPU's half-finished steps. Success of the
whole job needs the trainer's `final` record, never exit codes alone.

The trainer's `rollout` events (one per step: the engine's log-probs of its sampled tokens against the
trainer's, runtime/consistency.py) fold into `status.rollout.consistency` and the RolloutConsistent condition
(`RolloutFold`): each report is judged against spec.weightSync.rolloutConsistency, healthy ones feed the
rolling baseline, and a breach that follows a healthy report (or comes from a new trainer incarnation) starts
a new breach, reported once (the follower's Event and the action): a breach is known by when it began,
which status keeps, so a follower that replays a trimmed stream after a restart never reports one twice.

The trainers' `preflight` events (the runtime's IPC preflight, one per GPU and incarnation) make the IPCReady
condition: True once every GPU of the job passed in its newest incarnation, False with a failing GPU's
reason, else False/PreflightPending. Jobs whose runtime runs no preflight get no IPCReady condition.

Any container of the job can write the stream, so the tracker's state is bounded whatever arrives: GPUs
beyond `gpu_limit` (the least recently heard one goes first), half-finished steps beyond PENDING_STEPS_MAX
(the longest waiting goes first) and remembered failed steps beyond FAILED_STEPS_MAX; `dropped` counts what
was let go. Status messages are cut to what the CRD admits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from colocate_operator.conditions import Condition
from colocate_operator.constants import IPC_PREFLIGHT_FAILURES, Cond, Reason
from colocate_operator.spec import RolloutConsistencySpec
from colocate_operator.status import ConsistencyStatus, RolloutStatus, StepRecordStatus, WeightSyncStatus
from colocate_runtime.contract.events import RolloutFigures, StepEvent

# What `kubectl get` shows while a step moves through the runtime (status.weightSync.currentPhase).
PHASE_NAMES = {
    "published": "Publishing",
    "opened": "Opening",
    "copied": "Copying",
    "closed": "Closing",
    "acked": "Acknowledging",
    "freed": "Freeing",
    "finished": "Rollout",
    "failed": "Failed",
    "final": "Done",
    "preflight": "Preflight",
    "rollout": "Rollout",
    "completed": "Rollout",
}


PENDING_STEPS_MAX = 64  # steps some but not all GPUs finished (a real job has one or two)
FAILED_STEPS_MAX = 256  # failed steps remembered so several GPUs reporting one make one record
MESSAGE_MAX_CHARS = 1024  # status.recentSteps[].message maxLength in the CRD


def gpu_limit(expected_gpus: int) -> int:
    """GPUs tracked at once: the job's own plus room for rescheduled pods' new GPUs."""
    return 2 * expected_gpus + 16


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def precise(ts: float) -> str:
    """RFC 3339 to the microsecond: a time read back to tell one event from another."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class StepRecord:
    step: int
    result: str  # Succeeded | Failed
    sync_seconds: float
    bytes: int
    completion_time: float
    weight_version: str = ""
    message: str = ""

    def to_status(self) -> StepRecordStatus:
        return StepRecordStatus(
            step=self.step,
            weight_version=self.weight_version,
            result=self.result,
            sync_seconds=round(self.sync_seconds, 6),
            bytes=self.bytes,
            completion_time=iso(self.completion_time),
            message=self.message or None,
        )


@dataclass(frozen=True)
class PreflightOutcome:
    """The newest preflight news of one GPU: an attempt running (result ""), passed or failed."""

    gen: int
    result: str
    reason: str = ""
    message: str = ""
    ts: float = 0.0


NO_DATA_STEPS = 5  # steps completed past the last rollout report before RolloutConsistent says NoData


@dataclass(frozen=True)
class Breach:
    """One report over the bounds: its step, the reason (ROLLOUT_BREACHES) and the words status carries."""

    step: int
    reason: str
    message: str
    since: float = 0.0  # when the breach began: the ts of its first report


@dataclass
class RolloutFold:
    """The trainer's rollout reports, judged one by one. State is bounded by spec.baselineSteps."""

    policy: RolloutConsistencySpec = field(default_factory=RolloutConsistencySpec)
    step: int | None = None
    gen: int | None = None
    last: RolloutFigures | None = None
    breach: Breach | None = None  # the last report's, when it breached
    last_breach: Breach | None = None  # the newest breach, kept after healthy reports
    breaches: int = 0  # breaches started (a run of breaching reports is one)
    reported_since: float = 0.0  # the newest breach the follower reported (posted, acted on) began then
    _healthy: deque[float] = field(default_factory=deque)

    def observe(self, event: StepEvent) -> bool:
        """True when the report was taken (a status write is due)."""
        figures = event.rollout
        if figures is None or (self.step is not None and event.step <= self.step and event.gen == self.gen):
            return False  # a repeated or older report of the same trainer
        new_trainer = event.gen != self.gen
        self.step, self.gen, self.last = event.step, event.gen, figures
        baseline = self.baseline()
        breach = self._judge(event.step, figures, baseline)
        if breach is None:
            self._healthy.append(figures.kl)
            while len(self._healthy) > self.policy.baseline_steps:
                self._healthy.popleft()
        elif self.breach is None or new_trainer:
            self.breaches += 1
            breach = replace(breach, since=event.ts)
        else:
            breach = replace(breach, since=self.breach.since)
        self.breach = breach
        self.last_breach = breach or self.last_breach
        return True

    def baseline(self) -> float | None:
        if len(self._healthy) < min(self.policy.baseline_min_steps, self.policy.baseline_steps):
            return None
        return sum(self._healthy) / len(self._healthy)

    def _judge(self, step: int, f: RolloutFigures, baseline: float | None) -> Breach | None:
        p = self.policy
        detail = (
            f"|delta logp| mean {f.diff_mean:.4g}, max {f.diff_max:.4g}, {100 * f.over_fraction:.3g}% of "
            f"{f.tokens} tokens over {f.threshold:g}"
        )
        if f.kl > p.kl_threshold:
            message = f"step {step}: KL {f.kl:.4g} is over klThreshold {p.kl_threshold:g} ({detail})"
            return Breach(step, Reason.KL_OVER_THRESHOLD, message)
        if baseline is not None and f.kl > p.baseline_factor * baseline and f.kl > p.baseline_floor:
            message = (
                f"step {step}: KL {f.kl:.4g} is over {p.baseline_factor:g} x the rolling baseline "
                f"{baseline:.4g} ({len(self._healthy)} steps; {detail})"
            )
            return Breach(step, Reason.KL_OVER_BASELINE, message)
        return None

    def condition(self, last_completed_step: int | None) -> Condition | None:
        """RolloutConsistent; None until the first report (a trainer that never reports has none)."""
        if self.last is None or self.step is None:
            return None
        if self.breach is not None:
            return Condition(Cond.ROLLOUT_CONSISTENT, False, self.breach.reason, self.breach.message)
        if last_completed_step is not None and last_completed_step - self.step > NO_DATA_STEPS:
            return Condition(
                Cond.ROLLOUT_CONSISTENT,
                False,
                Reason.NO_DATA,
                f"the last rollout report is of step {self.step}; step {last_completed_step} completed since",
            )
        baseline = self.baseline()
        against = f"baseline {baseline:.4g}" if baseline is not None else "no baseline yet"
        return Condition(
            Cond.ROLLOUT_CONSISTENT,
            True,
            Reason.KL_WITHIN_BOUNDS,
            f"step {self.step}: KL {self.last.kl:.4g} ({against}; klThreshold {self.policy.kl_threshold:g})",
        )

    def status(self) -> RolloutStatus | None:
        if self.last is None or self.step is None:
            return None
        f, newest = self.last, self.last_breach
        return RolloutStatus(
            consistency=ConsistencyStatus(
                step=self.step,
                kl=f.kl,
                logp_diff_mean=f.diff_mean,
                logp_diff_max=f.diff_max,
                logp_over_fraction=f.over_fraction,
                logp_threshold=f.threshold,
                tokens=f.tokens,
                baseline_kl=self.baseline(),
                baseline_steps=len(self._healthy),
                breaches=self.breaches,
                last_breach_step=newest.step if newest else None,
                last_breach=newest.message[:MESSAGE_MAX_CHARS] if newest else None,
                last_breach_time=precise(newest.since) if newest else None,
            )
        )


@dataclass
class StepTracker:
    """One job's weight-sync progress. `observe` returns True when the event crossed a step boundary, i.e.
    when status is worth writing now; intermediate phases only update what the next write carries."""

    expected_gpus: int
    history_limit: int = 10
    last_completed_step: int | None = None
    weight_version: str = ""
    last_sync_seconds: float = 0.0
    last_sync_bytes: int = 0
    current_phase: str = ""
    last_progress_ts: float | None = None  # when the last step completed (or tracking started)
    paused_since: float | None = None  # the job is suspended (or suspending): no progress is expected
    final_result: str | None = None
    final_message: str = ""  # the first failed final record's: what the trainer said went wrong
    last_failure: StepRecord | None = None
    recent: list[StepRecord] = field(default_factory=list)
    _gens: dict[str, int] = field(default_factory=dict)  # GPU -> newest trainer incarnation seen
    _pending: dict[int, dict[str, StepEvent]] = field(default_factory=dict)
    _failed_steps: set[int] = field(default_factory=set)
    _preflight: dict[str, PreflightOutcome] = field(default_factory=dict)  # GPU -> newest preflight news
    _ipc_key: tuple[bool, str] | None = None  # IPCReady (status, reason) after the last preflight event
    dropped: int = 0  # GPUs and steps let go to keep the state bounded (the follower reports them)
    rollout: RolloutFold = field(default_factory=RolloutFold)

    def observe(self, event: StepEvent) -> bool:
        if event.phase == "completed":  # summary mode: the whole job's step in one record, no GPU of its own
            self.current_phase = PHASE_NAMES["completed"]
            return event.role == "trainer" and event.result == "ok" and self._complete(event.step, [event])
        gpu = event.gpu or f"rank-{event.rank}"
        newest = self._gens.get(gpu, event.gen)
        if event.gen < newest:
            return False  # a dead trainer incarnation's leftovers
        if event.gen > newest:  # that GPU's trainer restarted: its unfinished steps will not finish
            for gpus in self._pending.values():
                gpus.pop(gpu, None)
        self._gens.pop(gpu, None)  # re-inserted last: the dict's order is least recently heard first
        self._gens[gpu] = event.gen
        if len(self._gens) > gpu_limit(self.expected_gpus):
            self._forget_gpu(next(iter(self._gens)))
        self.current_phase = PHASE_NAMES.get(event.phase, event.phase)
        if event.role != "trainer":
            return False
        if event.phase == "preflight":
            return self._preflight_event(gpu, event)
        if event.phase == "rollout":
            return self.rollout.observe(event)
        if event.phase == "final":  # one trainer rank's failure fails the run; success needs no failure
            if event.result != "ok":
                if self.final_result != "Failed":
                    said = f"{event.result or 'error'} on GPU {event.gpu or event.rank}: {event.error}"
                    self.final_message = said.strip(": ")[:MESSAGE_MAX_CHARS]
                self.final_result = "Failed"
            elif self.final_result is None:
                self.final_result = "Succeeded"
            return True
        if event.phase == "failed" or (event.phase == "finished" and event.result != "ok"):
            return self._fail(event)
        if event.phase == "finished":
            return self._finish(event)
        return False

    def _finish(self, event: StepEvent) -> bool:
        if self.last_completed_step is not None and event.step <= self.last_completed_step:
            return False
        gpus = self._pending.setdefault(event.step, {})
        gpus[event.gpu or f"rank-{event.rank}"] = event
        if len(self._pending) > PENDING_STEPS_MAX:
            # The oldest, not the lowest: a flood of high step numbers cannot starve the real next step.
            del self._pending[next(iter(self._pending))]
            self.dropped += 1
        if len(gpus) < self.expected_gpus:
            return False
        return self._complete(event.step, list(gpus.values()))

    def _complete(self, step: int, events: list[StepEvent]) -> bool:
        """`step` finished on every GPU (`events`: each GPU's record, or the job's one `completed`)."""
        if self.last_completed_step is not None and step <= self.last_completed_step:
            return False
        self.last_completed_step = step
        self.weight_version = max((e.weight_version for e in events), key=_version_key)
        self.last_sync_seconds = max(e.seconds for e in events)
        self.last_sync_bytes = sum(e.bytes for e in events)
        self.last_progress_ts = max(e.ts for e in events)
        self.last_failure = None
        for done in [s for s in self._pending if s <= step]:
            del self._pending[done]
        self._remember(
            StepRecord(
                step,
                "Succeeded",
                self.last_sync_seconds,
                self.last_sync_bytes,
                self.last_progress_ts,
                self.weight_version,
            )
        )
        return True

    def _fail(self, event: StepEvent) -> bool:
        if event.step in self._failed_steps:
            return False  # one record per failed step, however many GPUs report it
        self._failed_steps.add(event.step)
        if len(self._failed_steps) > FAILED_STEPS_MAX:
            self._failed_steps.discard(min(self._failed_steps))
        self._pending.pop(event.step, None)
        message = f"{event.result or 'error'} on GPU {event.gpu or event.rank}: {event.error}".strip(": ")
        message = message[:MESSAGE_MAX_CHARS]
        record = StepRecord(event.step, "Failed", event.seconds, event.bytes, event.ts, message=message)
        self.last_failure = record
        self._remember(record)
        return True

    def _forget_gpu(self, gpu: str) -> None:
        del self._gens[gpu]
        self._preflight.pop(gpu, None)
        for gpus in self._pending.values():
            gpus.pop(gpu, None)
        self.dropped += 1

    def state_size(self) -> dict[str, int]:
        """How much the tracker holds (what the bounds above cap)."""
        return {
            "gpus": len(self._gens),
            "preflight_gpus": len(self._preflight),
            "pending_steps": len(self._pending),
            "pending_entries": sum(len(g) for g in self._pending.values()),
            "failed_steps": len(self._failed_steps),
            "recent": len(self.recent),
        }

    def _preflight_event(self, gpu: str, event: StepEvent) -> bool:
        """True when IPCReady's status or reason changed (a status write is due)."""
        if event.result not in ("", "ok", "error") or (
            event.result == "error" and event.reason not in IPC_PREFLIGHT_FAILURES
        ):
            return False  # not the preflight contract (events.py)
        old = self._preflight.get(gpu)
        if event.result == "" and old is not None and old.gen == event.gen and old.result == "error":
            # A Wait-mode retry: the failure it retries stands until an attempt passes.
            outcome = PreflightOutcome(old.gen, old.result, old.reason, old.message, event.ts)
        else:
            outcome = PreflightOutcome(event.gen, event.result, event.reason, event.error, event.ts)
        self._preflight[gpu] = outcome
        # Against what the previous preflight event left (`observe` already moved this GPU's incarnation).
        before, self._ipc_key = self._ipc_key, _key(self.ipc_ready())
        return self._ipc_key != before

    def ipc_ready(self) -> Condition | None:
        """IPCReady over the GPUs that reported most recently (a rescheduled pod's old GPUs fall out once
        its new ones report); None until a preflight event was seen."""
        if not self._preflight:
            return None
        current = {gpu: o for gpu, o in self._preflight.items() if o.gen == self._gens.get(gpu, o.gen)}
        newest = sorted(current.items(), key=lambda item: item[1].ts, reverse=True)[: self.expected_gpus]
        failed = sorted((gpu, o) for gpu, o in newest if o.result == "error")
        if failed:
            gpu, o = failed[0]
            more = f" ({len(failed)} GPUs failing)" if len(failed) > 1 else ""
            return Condition(Cond.IPC_READY, False, o.reason, f"GPU {gpu}: {o.message}{more}")
        passed = sum(1 for _, o in newest if o.result == "ok")
        if passed >= self.expected_gpus:
            return Condition(
                Cond.IPC_READY, True, Reason.PREFLIGHT_PASSED, f"all {passed} GPUs passed the IPC preflight"
            )
        return Condition(
            Cond.IPC_READY,
            False,
            Reason.PREFLIGHT_PENDING,
            f"{passed}/{self.expected_gpus} GPUs passed the IPC preflight",
        )

    def _remember(self, record: StepRecord) -> None:
        self.recent.append(record)
        del self.recent[: max(0, len(self.recent) - self.history_limit)]

    def stalled(self, now: float, deadline_seconds: float) -> bool:
        """No step completed within the progress deadline (counted from the last one, or from the start)."""
        if self.final_result is not None or self.last_progress_ts is None or self.paused_since is not None:
            return False
        return now - self.last_progress_ts > deadline_seconds

    def pause(self, paused: bool, now: float) -> None:
        """A suspended job makes no progress by design: no stall while it is paused, and the progress deadline
        counts again from the resume (a job Kueue preempted for hours is not a stalled one)."""
        if paused and self.paused_since is None:
            self.paused_since = now
        elif not paused and self.paused_since is not None:
            self.paused_since = None
            if self.last_progress_ts is not None:
                self.last_progress_ts = max(self.last_progress_ts, now)

    def weight_sync_status(self) -> WeightSyncStatus:
        done = self.last_completed_step is not None
        return WeightSyncStatus(
            current_phase=self.current_phase or "Pending",
            last_completed_step=self.last_completed_step,
            weight_version=self.weight_version if done else None,
            last_sync_seconds=round(self.last_sync_seconds, 6) if done else None,
            last_sync_bytes=self.last_sync_bytes if done else None,
            final_step_recorded=True if self.final_result is not None else None,
            final_result=self.final_result,
            final_message=self.final_message or None,
        )

    def recent_steps_status(self) -> tuple[StepRecordStatus, ...]:
        return tuple(r.to_status() for r in self.recent)


def _key(condition: Condition | None) -> tuple[bool, str] | None:
    return None if condition is None else (condition.status, condition.reason)


def _version_key(version: str) -> tuple[int, int, str]:
    """Numeric versions compare as numbers, others as text."""
    return (1, int(version), "") if version.isdigit() else (0, 0, version)


def step_conditions(tracker: StepTracker, stalled: bool, deadline_seconds: float) -> list[Condition]:
    """WeightSyncHealthy, Progressing, IPCReady and RolloutConsistent: the step consumer's conditions."""
    updates: list[Condition] = []
    ipc = tracker.ipc_ready()
    if ipc is not None:
        updates.append(ipc)
    consistent = tracker.rollout.condition(tracker.last_completed_step)
    if consistent is not None:
        updates.append(consistent)
    if tracker.last_failure is not None:
        failure = tracker.last_failure
        updates.append(
            Condition(
                Cond.WEIGHT_SYNC_HEALTHY,
                False,
                "StepFailed",
                f"step {failure.step} failed: {failure.message}",
            )
        )
    elif tracker.last_completed_step is not None:
        updates.append(
            Condition(
                Cond.WEIGHT_SYNC_HEALTHY,
                True,
                "StepSucceeded",
                f"step {tracker.last_completed_step} synced in {tracker.last_sync_seconds:.3f} s",
            )
        )
    if tracker.final_result is not None:
        updates.append(
            Condition(
                Cond.PROGRESSING,
                False,
                "TrainingFinished",
                f"the trainer's final record says {tracker.final_result}"
                + (f": {tracker.final_message}" if tracker.final_message else ""),
            )
        )
    elif stalled:
        updates.append(
            Condition(
                Cond.PROGRESSING,
                False,
                "StepStalled",
                f"no weight-update step completed within progressDeadlineSeconds ({deadline_seconds:.0f} s)",
            )
        )
    elif tracker.last_completed_step is not None:
        updates.append(
            Condition(
                Cond.PROGRESSING, True, "StepCompleted", f"step {tracker.last_completed_step} completed"
            )
        )
    return updates
