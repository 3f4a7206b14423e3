"""What the reconciler saw, reduced to the facts decisions need. Pure: built from API objects (dicts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colocate_operator.constants import CLAIM_NAME, LABEL_REPLICA_INDEX, LABEL_RESTART


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _owned_by(body: dict[str, Any], uid: str) -> bool:
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in body.get("metadata", {}).get("ownerReferences") or []
    )


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

    @classmethod
    def from_body(cls, body: dict[str, Any], job_uid: str) -> PodState:
        meta, status = body.get("metadata", {}), body.get("status") or {}
        labels = meta.get("labels") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
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
            scheduled=bool((body.get("spec") or {}).get("nodeName"))
            or conditions.get("PodScheduled") == "True",
            ready=conditions.get("Ready") == "True",
            reason=status.get("reason"),
            message=status.get("message"),
            claim=claim,
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
class Observed:
    """`children` holds `Kind/name` of every non-pod child that exists and belongs to this job."""

    pods: tuple[PodState, ...] = ()
    children: frozenset[str] = frozenset()
    metastore_ready: bool = False
    external_secret_found: bool | None = None  # None: not checked (mode Managed) or not readable
    device_class_found: bool | None = None  # None: not checked or not readable
    claims: dict[str, ClaimState] = field(default_factory=dict)


def child_key(body: dict[str, Any]) -> str:
    return f"{body['kind']}/{body['metadata']['name']}"
