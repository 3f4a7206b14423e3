"""What one reconcile decision works on and hands back: its Pass (working state) and its Plan. Pure.

decide.py runs the checklist; its steps (suspension.py, transitions.py, ...) read the Pass, add conditions
and Events to it, set their part of the typed status on it, and the last one turns it into the Plan
(`Pass.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from colocate_operator import conditions
from colocate_operator.conditions import Condition
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Phase, Reason
from colocate_operator.observed import CreateRefusal, Observed, PodState
from colocate_operator.spec import ColocateJob
from colocate_operator.status import JobStatus, StatusView, reconciler_status, with_fields, with_part

SOON = 1.0  # seconds: re-check after creating or deleting, when no watch event may come
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

    @classmethod
    def of(cls, pod: PodState) -> PodRef:
        return cls(pod.name, pod.uid)


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


def min_delay(*delays: float | None) -> float | None:
    present = [d for d in delays if d is not None]
    return max(0.0, min(present)) if present else None


def create_backoff(attempts: int) -> float:
    """Seconds to wait after `attempts` refused creates in a row: 5, 10, 20, ... capped at 300."""
    if attempts <= 0:
        return 0.0
    return float(min(CREATE_BACKOFF_CAP_SECONDS, CREATE_BACKOFF_SECONDS * 2 ** min(attempts - 1, 30)))


def create_retry_at(refusal: CreateRefusal) -> datetime:
    return refusal.at + timedelta(seconds=create_backoff(refusal.attempts))


def live_refs(pods: tuple[PodState, ...] | list[PodState]) -> list[PodRef]:
    """The pods not being deleted already."""
    return [PodRef.of(pod) for pod in pods if not pod.deleting]


def unfinished_refs(pods: tuple[PodState, ...] | list[PodState]) -> list[PodRef]:
    """The pods to delete when the job ends: finished ones stay for their logs."""
    return [PodRef.of(pod) for pod in pods if not pod.deleting and pod.phase not in FINISHED]


@dataclass
class Pass:
    """Working state of one decision; turned into a Plan at the end (`plan`)."""

    job: ColocateJob
    status: StatusView  # as read
    observed: Observed
    now: datetime
    config: OperatorConfig
    desired: JobStatus = field(default_factory=JobStatus)  # the reconciler's part, as the steps set it
    updates: list[Condition] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    force_deletes: list[PodRef] = field(default_factory=list)
    wake: float | None = None  # seconds until a stuck pod is due for a forced deletion
    checkpoint: CheckpointWrite | None = None
    suspended_by: str = Reason.SUSPENDED_BY_USER  # or Kueue's eviction (kueue_admission)

    @property
    def n(self) -> int:
        return self.job.spec.num_nodes

    @property
    def phase(self) -> str:
        """The phase as read (the one this pass started from)."""
        return self.status.phase or Phase.PENDING

    def set(self, **fields: Any) -> None:
        self.desired = with_fields(self.desired, **fields)

    def take(self, part: Any) -> None:
        """Set a step's part of the status (a partial model of status.py)."""
        self.desired = with_part(self.desired, part)

    def condition(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.updates.append(Condition(type_, status, reason, message))

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(EventSpec(type_, reason, message))

    def previous_reason(self, type_: str) -> str | None:
        found = self.status.condition(type_)
        return found.get("reason") if found else None

    def plan(
        self,
        *,
        creates: list[dict[str, Any]] | None = None,
        deletes: list[PodRef] | None = None,
        persist_first: bool = False,
        delete_job: bool = False,
        requeue_after: float | None = None,
    ) -> Plan:
        merged = conditions.merge(self.status.conditions, self.updates, self.now, self.job.ref.generation)
        # Children of a kind the API server refused wait for its backoff to end (pods: pod_gate.py, with a
        # condition).
        held = {
            r.kind: create_retry_at(r) for r in self.observed.create_refusals if self.now < create_retry_at(r)
        }
        dropped = [held[m["kind"]] for m in creates or () if m["kind"] in held]
        if dropped:
            requeue_after = min_delay(requeue_after, (min(dropped) - self.now).total_seconds())
        return Plan(
            status=reconciler_status(self.desired, merged),
            creates=tuple(m for m in creates or () if m["kind"] not in held),
            deletes=tuple(deletes or ()),
            force_deletes=tuple(self.force_deletes),
            persist_first=persist_first,
            delete_job=delete_job,
            events=tuple(self.events),
            checkpoint=self.checkpoint,
            requeue_after=min_delay(requeue_after, self.wake, SOON if self.force_deletes else None),
        )
