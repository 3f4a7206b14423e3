"""What the reconciler saw, reduced to the facts decisions need. Pure: built from API objects (dicts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from colocate_operator.constants import (
    CLAIM_NAME,
    CONTAINER_ROLLOUT,
    CONTAINER_TRAINER,
    LABEL_REPLICA_INDEX,
    LABEL_RESTART,
)
from colocate_operator.kueue import Placement, WorkloadState
from colocate_runtime.contract.events import is_final_termination_message


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _unschedulable(conditions: list[dict[str, Any]]) -> str | None:
    """The scheduler's own words (e.g. "0/5 nodes are available: 4 Insufficient nvidia.com/gpu") while the
    pod cannot be placed; the job's conditions repeat them instead of a bare count."""
    for c in conditions:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message") or c.get("reason") or "Unschedulable")
    return None


def _owned_by(body: dict[str, Any], uid: str) -> bool:
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in body.get("metadata", {}).get("ownerReferences") or []
    )


def _engine_facts(body: dict[str, Any]) -> dict[str, Any]:
    """PodState's engine_* fields from the rollout container's spec and status."""
    containers = (body.get("spec") or {}).get("containers") or []
    spec = next((c for c in containers if c.get("name") == CONTAINER_ROLLOUT), {})
    statuses = (body.get("status") or {}).get("containerStatuses") or []
    status = next((c for c in statuses if c.get("name") == CONTAINER_ROLLOUT), {})
    exited = (status.get("state") or {}).get("terminated")
    last = (status.get("lastState") or {}).get("terminated")
    return {
        "engine_restarts": int(status.get("restartCount") or 0),
        "engine_ready": bool(status.get("ready")),
        "engine_exit_code": int(exited.get("exitCode") or 0) if exited else None,
        "engine_last_exit_code": int(last.get("exitCode") or 0) if last else None,
        "engine_restart_in_place": bool(spec.get("restartPolicyRules")),
    }


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    index: int | None
    restart: int | None
    owned: bool
    phase: str
    deleting: bool
    scheduled: bool
    ready: bool
    reason: str | None = None
    message: str | None = None
    claim: str | None = None
    unschedulable: str | None = None  # the scheduler's message while PodScheduled is False
    created: datetime | None = None
    # When a graceful deletion should have ended (metadata.deletionTimestamp): a pod still here long after
    # it sits on a node that no longer answers.
    delete_by: datetime | None = None
    node: str | None = None
    # The trainer container ended with the final record as its termination message (events.py): the pod's
    # own proof that training finished, kept with the pod whatever happened to the meta-store.
    final_message: bool = False
    # The trainer container has terminated (any exit code). After the final record such a pod is done even
    # while its SGLang container still serves: nothing else ever makes an engine exit on a real kubelet.
    trainer_exited: bool = False
    # The SGLang (rollout) container: how often the kubelet restarted it in place (restartCount), whether it
    # is ready, its exit code while it is terminated, the last exit before a restart (lastState), and whether
    # the stored pod asks for in-place restarts (restartPolicyRules: an apiserver without the
    # ContainerRestartRules feature drops them, and the kubelet then leaves the container exited).
    engine_restarts: int = 0
    engine_ready: bool = False
    engine_exit_code: int | None = None
    engine_last_exit_code: int | None = None
    engine_restart_in_place: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any], job_uid: str) -> PodState:
        meta, status = body.get("metadata", {}), body.get("status") or {}
        labels = meta.get("labels") or {}
        pod_conditions = list(status.get("conditions") or [])
        conditions = {c.get("type"): c.get("status") for c in pod_conditions}
        node = (body.get("spec") or {}).get("nodeName")
        claim = next(
            (
                c.get("resourceClaimName")
                for c in status.get("resourceClaimStatuses") or []
                if c.get("name") == CLAIM_NAME
            ),
            None,
        )
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            index=_int_label(labels, LABEL_REPLICA_INDEX),
            restart=_int_label(labels, LABEL_RESTART),
            owned=_owned_by(body, job_uid),
            phase=status.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            scheduled=bool(node) or conditions.get("PodScheduled") == "True",
            ready=conditions.get("Ready") == "True",
            reason=status.get("reason"),
            message=status.get("message"),
            claim=claim,
            unschedulable=None if node else _unschedulable(pod_conditions),
            created=_time(meta.get("creationTimestamp")),
            delete_by=_time(meta.get("deletionTimestamp")),
            node=node or None,
            final_message=any(
                c.get("name") == CONTAINER_TRAINER
                and is_final_termination_message(
                    ((c.get("state") or {}).get("terminated") or {}).get("message")
                )
                for c in status.get("containerStatuses") or []
            ),
            trainer_exited=any(
                c.get("name") == CONTAINER_TRAINER and (c.get("state") or {}).get("terminated") is not None
                for c in status.get("containerStatuses") or []
            ),
            **_engine_facts(body),
        )

    def describe(self) -> str:
        detail = ": ".join(p for p in (self.reason, self.message) if p)
        return f"pod {self.name} is {self.phase}" + (f" ({detail})" if detail else "")


@dataclass(frozen=True)
class ClaimState:
    name: str
    allocated: bool
    devices: tuple[str, ...] = ()

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ClaimState:
        allocation = (body.get("status") or {}).get("allocation")
        results = ((allocation or {}).get("devices") or {}).get("results") or []
        devices = tuple(f"{r.get('pool')}/{r.get('device')}" for r in results)
        return cls(name=body["metadata"]["name"], allocated=allocation is not None, devices=devices)


@dataclass(frozen=True)
class ForeignChild:
    """An object holding one of the job's child names that the job does not own (another job's, a user's,
    or the predecessor's of a job re-created under the same name while garbage collection removes it)."""

    key: str  # Kind/name
    owner: str = ""  # "ColocateJob other" or "" when it has no controller
    deleting: bool = False

    def describe(self, namespace: str) -> str:
        kind, _, name = self.key.partition("/")
        whose = f"owned by {self.owner}" if self.owner else "not owned by this job"
        return f"{kind} {namespace}/{name} exists, {whose}" + (" (being deleted)" if self.deleting else "")

    @classmethod
    def from_body(cls, key: str, body: dict[str, Any]) -> ForeignChild:
        meta = body.get("metadata") or {}
        owner = next(
            (
                f"{ref.get('kind')} {ref.get('name')}"
                for ref in meta.get("ownerReferences") or []
                if ref.get("controller")
            ),
            "",
        )
        return cls(key, owner, bool(meta.get("deletionTimestamp")))


@dataclass(frozen=True)
class CheckpointState:
    """The suspend checkpoint records in the job's meta-store (contract/checkpoint.py), read while a suspend
    waits: the trainer ranks that registered for requests, the request there now, and each rank's ACK as
    (request id, step). `readable` False: the meta-store did not answer (nothing is known of the trainer);
    `pending` also: the first read is still on its way (checkpoints.py reads off the reconcile workers), so
    nothing may be concluded from the absence of trainer ranks yet."""

    readable: bool
    pending: bool = False
    ranks: frozenset[str] = frozenset()
    request_id: str | None = None
    acks: dict[str, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class CreateRefusal:
    """The API server refused creating this job's children of one kind (admission: a quota, a policy; or an
    error), `attempts` times in a row, the last `at`; `message` is the server's. Kept by the reconciler in
    memory until a create of that kind succeeds (issue 30, item 6)."""

    kind: str
    name: str
    attempts: int
    at: datetime
    message: str


@dataclass(frozen=True)
class Observed:
    """`children` holds `Kind/name` of every non-pod child that exists and belongs to this job; `foreign`
    the child names held by objects the job does not own.

    `final_record` is the step follower's answer to "did the trainer record its final step?", asked only
    when a pod has exited without status saying so: True (it did), False (the follower read the stream to
    its end after the pod exited, and it did not), None (no answer); `final_record_pending` says an answer
    is still worth waiting for (the reconciler bounds that wait)."""

    pods: tuple[PodState, ...] = ()
    children: frozenset[str] = frozenset()
    foreign: tuple[ForeignChild, ...] = ()
    metastore_ready: bool = False
    external_secret_found: bool | None = None  # None: not checked (mode Managed) or not readable
    device_class_found: bool | None = None  # None: not checked or not readable
    claims: dict[str, ClaimState] = field(default_factory=dict)
    final_record: bool | None = None
    final_failure: str | None = None  # with final_record True: the trainer's message when the run failed
    final_record_pending: bool = False
    # (name, uid) of the Managed Redis pods, listed only when this job's Redis runs but its Secret is gone.
    metastore_pods: tuple[tuple[str, str], ...] = ()
    # Read only while a suspend waits for the step in flight and the trainer's checkpoint (checkpoints.py).
    checkpoint: CheckpointState | None = None
    # Why the last checkpoint write into the store failed (checkpoints.py), until one succeeds: on resume,
    # the withdraw the new pods wait for.
    checkpoint_write_error: str | None = None
    # A job with a Kueue queue: its Workload (None: none yet) and, while there is none, the value of its
    # WorkloadPriorityClass (None: no class, or not found).
    workload: WorkloadState | None = None
    workload_priority: int | None = None
    workload_placement: Placement | None = None  # the admitted flavors' node labels and tolerations
    # Kinds whose last create the API server refused (CreateRefusal): held back until their backoff ends.
    create_refusals: tuple[CreateRefusal, ...] = ()


@dataclass
class StreamProgress:
    """What a job's step follower (stepwatch.py) has read, for the reconciler's catch-up barrier: whether the
    trainer's final record was among it, and when the newest XREAD that reached the stream's end was issued
    (wall-clock seconds; 0 before the first). Written on the event loop, read by reconcile workers: two
    plain attributes, each replaced whole."""

    final: bool = False
    final_failure: str | None = None  # the trainer's message when its final record says the run failed
    caught_up_at: float = 0.0
    paused: bool = False  # the job is Suspending or Suspended (its watch events say): no stall is counted


def child_key(body: dict[str, Any]) -> str:
    return f"{body['kind']}/{body['metadata']['name']}"
