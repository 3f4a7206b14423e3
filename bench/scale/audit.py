"""Counting an operator's API requests from the apiserver's audit log.

The testbed's audit policy records the operators' service accounts, once per request (stage
ResponseComplete), so every line of theirs is one request that operator sent; and the controller-manager's
writes of CONTROLLER_RESOURCES, which an operator's objects cause (`in_namespace`). A request belongs to a
window by the time the apiserver received it (requestReceivedTimestamp).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# Written only by the controller-manager here: a PodDisruptionBudget's status (its disruption controller),
# a Service's EndpointSlices and Endpoints (as its pods come and go).
CONTROLLER_RESOURCES = frozenset({"poddisruptionbudgets", "endpointslices", "endpoints"})


@dataclass(frozen=True)
class Request:
    received: float
    user: str
    namespace: str
    verb: str
    resource: str
    subresource: str
    code: int


@dataclass
class AuditLog:
    path: Path
    requests: list[Request] = field(default_factory=list)
    _offset: int = 0

    def refresh(self) -> None:
        """Read what the apiserver appended since the last call (whole lines only)."""
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self.requests.append(_parse(json.loads(line)))

    def window(self, user: str, start: float, end: float) -> list[Request]:
        return [r for r in self.requests if r.user == user and start <= r.received < end]

    def in_namespace(self, namespace: str, start: float, end: float, users: set[str]) -> list[Request]:
        """The controller-manager's writes in one run's namespace: CONTROLLER_RESOURCES by anyone not in
        `users` (the operators)."""
        return [
            r
            for r in self.requests
            if r.namespace == namespace
            and r.user not in users
            and r.resource in CONTROLLER_RESOURCES
            and start <= r.received < end
        ]


def _parse(event: dict[str, Any]) -> Request:
    ref = event.get("objectRef") or {}
    received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
    return Request(
        received=received,
        user=(event.get("user") or {}).get("username", ""),
        namespace=ref.get("namespace", ""),
        verb=event.get("verb", ""),
        resource=ref.get("resource", ""),
        subresource=ref.get("subresource", ""),
        code=int((event.get("responseStatus") or {}).get("code") or 0),
    )


@dataclass(frozen=True)
class RequestCounts:
    total: int
    writes: int
    status_writes: int  # update/patch of the job's status subresource
    job_writes: int  # update/patch of the job object itself (annotations, finalizers)
    errors: Counter[int]  # HTTP codes >= 400
    by_kind: Counter[str]  # "verb resource[/subresource]"

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "writes": self.writes,
            "status_writes": self.status_writes,
            "job_writes": self.job_writes,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "by_kind": dict(self.by_kind.most_common()),
        }


def count(requests: list[Request], job_plural: str) -> RequestCounts:
    errors: Counter[int] = Counter(r.code for r in requests if r.code >= 400)
    by_kind: Counter[str] = Counter(
        f"{r.verb} {r.resource}" + (f"/{r.subresource}" if r.subresource else "") for r in requests
    )
    job_updates = [r for r in requests if r.resource == job_plural and r.verb in ("update", "patch")]
    return RequestCounts(
        total=len(requests),
        writes=sum(1 for r in requests if r.verb in WRITE_VERBS),
        status_writes=sum(1 for r in job_updates if r.subresource == "status" and r.code < 400),
        job_writes=sum(1 for r in job_updates if not r.subresource and r.code < 400),
        errors=errors,
        by_kind=by_kind,
    )
