"""The ColocateJob status, as a model beside the spec: every key, its shape, and which writer owns it.

Two writers share a job's status. The reconciler owns its lifecycle (phase, restarts, timestamps, replica
counts); the step follower (stepwatch.py) owns what the step stream says (weightSync, recentSteps). The list
of conditions is shared, each condition type owned by one writer (CONDITION_OWNERS): both writers merge only
their own types into the list they read, and write it guarded by the resourceVersion they read it at.

Each key is marked with its owner(s) here, and the owned-keys lists, the reconciler's merge patch and the
step follower's patch all derive from those marks: a key no writer owns is never written, and a key cannot
be written by the wrong one. The models mirror the CRD's status schema (a unit test compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer
from pydantic.alias_generators import to_camel

from colocate_operator.constants import Cond


class Owner(StrEnum):
    RECONCILER = "reconciler"
    STEPS = "steps"  # the step follower


CONDITION_OWNERS: dict[str, Owner] = {
    **dict.fromkeys(Cond.RECONCILED, Owner.RECONCILER),
    Cond.WEIGHT_SYNC_HEALTHY: Owner.STEPS,
    Cond.PROGRESSING: Owner.STEPS,
    Cond.IPC_READY: Owner.STEPS,
    Cond.ROLLOUT_CONSISTENT: Owner.STEPS,
}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ReplicaStatus(_Model):
    desired: int = 0
    created: int = 0
    scheduled: int = 0
    running: int = 0
    ready: int = 0
    failed: int = 0


class MetaStoreStatus(_Model):
    mode: str
    address: str
    secret_name: str


class ClaimStatus(_Model):
    pod: str
    claim: str
    allocated: bool
    devices: tuple[str, ...] = ()


class ConditionStatus(_Model):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class SuspensionStatus(_Model):
    request_time: str | None = None
    checkpoint_requested: bool | None = None
    outcome: str | None = None
    after_step: int | None = None
    checkpoint_step: int | None = None


class WeightSyncStatus(_Model):
    current_phase: str = "Pending"
    last_completed_step: int | None = None
    weight_version: str | None = None
    last_sync_seconds: float | None = None
    last_sync_bytes: int | None = None
    final_step_recorded: bool | None = None
    final_result: str | None = None  # Succeeded | Failed: what the trainer's final record says
    final_message: str | None = None  # a failed final record's message (the trainer's error)


class StepRecordStatus(_Model):
    step: int
    weight_version: str = ""
    result: str
    sync_seconds: float
    bytes: int
    completion_time: str
    message: str | None = None


class ConsistencyStatus(_Model):
    """status.rollout.consistency: the trainer's last rollout report, the rolling baseline, the breaches."""

    step: int
    kl: float
    logp_diff_mean: float
    logp_diff_max: float
    logp_over_fraction: float
    logp_threshold: float
    tokens: int
    baseline_kl: float | None = Field(None, alias="baselineKL")
    baseline_steps: int = 0
    breaches: int = 0
    last_breach_step: int | None = None
    last_breach: str | None = None
    last_breach_time: str | None = None  # when the newest breach began (its first report's time)

    # People read these (`kubectl get` prints the KL column as written): four significant digits say all a
    # threshold needs, where a raw float prints up to 17. The metrics keep the full values.
    @field_serializer("kl", "logp_diff_mean", "logp_diff_max", "logp_over_fraction", "baseline_kl")
    def _four_digits(self, value: float | None) -> float | None:
        return None if value is None else float(f"{value:.4g}")


class RolloutStatus(_Model):
    consistency: ConsistencyStatus | None = None


R, S = Owner.RECONCILER, Owner.STEPS


class JobStatus(_Model):
    phase: Annotated[str | None, R] = None
    observed_generation: Annotated[int | None, R] = None
    restarts: Annotated[int, R] = 0  # the group incarnation; pods carry it as a label
    engine_restarts: Annotated[int | None, R] = None  # SGLang restarted in place, over the job's life
    engine_restarts_counted: Annotated[int | None, R] = None  # of those, the current group's (group.py)
    group_created: Annotated[bool, R] = False  # whether a missing pod is a failure or not created yet
    ready: Annotated[str | None, R] = None
    start_time: Annotated[str | None, R] = None
    last_restart_time: Annotated[str | None, R] = None
    completion_time: Annotated[str | None, R] = None
    suspension: Annotated[SuspensionStatus | None, R] = None
    replicas: Annotated[ReplicaStatus | None, R] = None
    meta_store: Annotated[MetaStoreStatus | None, R] = None
    resource_claims: Annotated[tuple[ClaimStatus, ...] | None, R] = None
    conditions: Annotated[tuple[ConditionStatus, ...], R, S] = ()  # each type has one owner
    weight_sync: Annotated[WeightSyncStatus | None, S] = None
    recent_steps: Annotated[tuple[StepRecordStatus, ...] | None, S] = None
    rollout: Annotated[RolloutStatus | None, S] = None

    @classmethod
    def of(cls, status: Mapping[str, Any] | None) -> JobStatus:
        return cls.model_validate(status or {})


def _alias(field: str) -> str:
    return JobStatus.model_fields[field].alias or field


def owners(field: str) -> tuple[Owner, ...]:
    return tuple(m for m in JobStatus.model_fields[field].metadata if isinstance(m, Owner))


def owned_keys(owner: Owner) -> tuple[str, ...]:
    """The status keys (as written, camelCase) that `owner` writes."""
    return tuple(_alias(name) for name in JobStatus.model_fields if owner in owners(name))


RECONCILER_KEYS = owned_keys(Owner.RECONCILER)
_RECONCILER_FIELDS = frozenset(name for name in JobStatus.model_fields if Owner.RECONCILER in owners(name))
STEP_KEYS = owned_keys(Owner.STEPS)
_STEP_FIELDS = tuple(name for name in JobStatus.model_fields if Owner.STEPS in owners(name))


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch turning `current` into `desired` for the reconciler's keys; {} if nothing changed.
    A key of `desired` the reconciler does not own is an error: it would never be written."""
    foreign = set(desired) - set(RECONCILER_KEYS)
    if foreign:
        raise ValueError(f"status keys {sorted(foreign)} are not the reconciler's (status.py)")
    patch: dict[str, Any] = {}
    for key in RECONCILER_KEYS:
        if key in desired and current.get(key) != desired[key]:
            patch[key] = desired[key]
        elif key not in desired and current.get(key) is not None:
            patch[key] = None  # merge-patch null removes it
    return patch


def step_patch(
    weight_sync: WeightSyncStatus,
    recent_steps: tuple[StepRecordStatus, ...],
    conditions: list[dict[str, Any]],
    rollout: RolloutStatus | None = None,
) -> dict[str, Any]:
    """The step follower's part of status, every key it owns (`conditions` already merged)."""
    part = JobStatus(weight_sync=weight_sync, recent_steps=recent_steps, rollout=rollout).model_dump(
        mode="json", by_alias=True, exclude_none=True, include=set(_STEP_FIELDS) - {"conditions"}
    )
    return {**part, _alias("conditions"): conditions}


class PodsPart(_Model):
    """What the current group's pods show: status.replicas, status.ready, status.resourceClaims."""

    replicas: ReplicaStatus
    ready: str
    resource_claims: tuple[ClaimStatus, ...] = ()


class EnginesPart(_Model):
    """SGLang's in-place restarts (group.py): a field left unset is not written."""

    engine_restarts: int | None = None
    engine_restarts_counted: int | None = None


def with_part(status: JobStatus, part: BaseModel) -> JobStatus:
    """`status` with the fields `part` set (a partial model's fields are named as JobStatus's)."""
    return with_fields(status, **{name: getattr(part, name) for name in part.model_fields_set})


def with_fields(status: JobStatus, **fields: Any) -> JobStatus:
    """`status` with `fields` replaced, validated: a name JobStatus lacks, or a value of the wrong type, is an
    error, not a key silently dropped or written wrong."""
    unknown = set(fields) - set(JobStatus.model_fields)
    if unknown:
        raise ValueError(f"no status fields {sorted(unknown)} (status.py)")
    return JobStatus.model_validate({**dict(status), **fields})


def reconciler_status(status: JobStatus, conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """The reconciler's desired status as written (camelCase, no None): `status`'s reconciler fields with
    `conditions` (already merged, passed through as they are: other writers' conditions stay untouched)."""
    part = status.model_dump(
        mode="json", by_alias=True, exclude_none=True, include=set(_RECONCILER_FIELDS) - {"conditions"}
    )
    return {**part, _alias("conditions"): conditions}


def without(patch: Mapping[str, Any], field: str) -> dict[str, Any]:
    """`patch` (a status merge patch) without its change of `field` (a JobStatus field name)."""
    return {key: value for key, value in patch.items() if key != _alias(field)}


@dataclass(frozen=True)
class StatusView:
    """Typed reads of a status as the API server holds it, for the modules that ask one thing of it (an event
    filter, a pass's catch-up barrier) without parsing all of it: no module but this one spells a key."""

    raw: Mapping[str, Any]

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> StatusView:
        return cls(body.get("status") or {})

    @property
    def phase(self) -> str | None:
        return self.raw.get(_alias("phase"))

    @property
    def restarts(self) -> int:
        return int(self.raw.get(_alias("restarts")) or 0)

    @property
    def group_created(self) -> bool:
        return bool(self.raw.get(_alias("group_created")))

    def has(self, field: str) -> bool:
        """Whether `field` (a JobStatus field name) is written: in a patch, whether it changes."""
        return _alias(field) in self.raw

    @property
    def start_time(self) -> str | None:
        return self.raw.get(_alias("start_time")) or None

    @property
    def last_restart_time(self) -> str | None:
        return self.raw.get(_alias("last_restart_time")) or None

    @property
    def completion_time(self) -> str | None:
        return self.raw.get(_alias("completion_time")) or None

    @property
    def suspension(self) -> SuspensionStatus | None:
        raw = self.raw.get(_alias("suspension"))
        return SuspensionStatus.model_validate(raw) if raw else None

    @property
    def engine_restarts(self) -> int | None:
        """None when the status never counted one (the key is then not written either)."""
        value = self.raw.get(_alias("engine_restarts"))
        return None if value is None else int(value)

    @property
    def engine_restarts_counted(self) -> int | None:
        value = self.raw.get(_alias("engine_restarts_counted"))
        return None if value is None else int(value)

    @property
    def conditions(self) -> list[dict[str, Any]]:
        return list(self.raw.get(_alias("conditions")) or [])

    @property
    def sync_phase(self) -> str | None:
        """status.weightSync.currentPhase as written (None before the step follower wrote one)."""
        return self._weight_sync.get(WeightSyncStatus.model_fields["current_phase"].alias)

    @property
    def last_completed_step(self) -> int | None:
        return self._weight_sync.get(WeightSyncStatus.model_fields["last_completed_step"].alias)

    @property
    def _weight_sync(self) -> Mapping[str, Any]:
        return self.raw.get(_alias("weight_sync")) or {}

    @property
    def final_step_recorded(self) -> bool:
        """Whether the step follower wrote the trainer's final record."""
        return bool(self._weight_sync.get(WeightSyncStatus.model_fields["final_step_recorded"].alias))

    @property
    def final_failure(self) -> str | None:
        """The trainer's message when its final record says the training failed; None otherwise (no final
        record, or a successful one: a status written before `finalResult` existed had only successes)."""
        if self._weight_sync.get(WeightSyncStatus.model_fields["final_result"].alias) != "Failed":
            return None
        return self._weight_sync.get(WeightSyncStatus.model_fields["final_message"].alias) or "no message"

    @property
    def rollout_breach_since(self) -> float:
        """When the newest breach in status.rollout.consistency began, Unix seconds (0 without one): a
        restarted follower reports no breach that began before."""
        rollout = self.raw.get(_alias("rollout")) or {}
        consistency = rollout.get(RolloutStatus.model_fields["consistency"].alias or "consistency") or {}
        text = consistency.get(ConsistencyStatus.model_fields["last_breach_time"].alias)
        try:
            return datetime.fromisoformat(str(text)).timestamp() if text else 0.0
        except ValueError:
            return 0.0

    def condition(self, type_: str) -> Mapping[str, Any] | None:
        return next((c for c in self.raw.get(_alias("conditions")) or () if c.get("type") == type_), None)


def final_step_recorded(status: Mapping[str, Any]) -> bool:
    """Whether the step follower wrote the trainer's final record (the reconciler's decisions read it)."""
    return StatusView(status).final_step_recorded


def final_failure(status: Mapping[str, Any]) -> str | None:
    """The trainer's message if its final record says the training failed (decide.py fails the job on it)."""
    return StatusView(status).final_failure
