"""Which watch events can change a decision: the last relevant state of each watched object, per event.

Most events change nothing the reconciler reads (the job's own status writes, kubelet heartbeats in pod
conditions, managedFields); queuing a pass for each would multiply API reads by the number of events.
Only the event loop calls these (kopf's async handlers), so no lock.
"""

from __future__ import annotations

from typing import Any

from colocate_operator.constants import Cond, Phase
from colocate_operator.decide import ipc_preflight_failure
from colocate_operator.observed import PodState
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView

DELETED = "DELETED"


def _meta(body: dict[str, Any]) -> dict[str, Any]:
    return body.get("metadata") or {}


def ipc_preflight_failed(body: dict[str, Any]) -> bool:
    """IPCReady is written by the step consumer, not through the spec: in Fail mode, fail the job at once
    rather than at the next resync. The cheap test first: most events carry no failed IPCReady."""
    status = StatusView.of(body)
    ipc = status.condition(Cond.IPC_READY)
    if status.phase in Phase.TERMINAL or ipc is None or ipc.get("status") != "False":
        return False
    return ipc_preflight_failure(ColocateJob.from_body(body), dict(status.raw)) is not None


class EventMarks:
    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._pods: dict[str, PodState] = {}
        self._metastores: dict[str, tuple[Any, ...]] = {}

    def job_changed(self, event_type: str | None, namespace: str, name: str, body: dict[str, Any]) -> bool:
        """First sight, deletion, or a new spec generation or labels; not the job's status writes."""
        key = (namespace, name)
        if event_type == DELETED:
            self._jobs.pop(key, None)
            return True
        meta = _meta(body)
        mark = (
            meta.get("uid"),
            meta.get("generation"),
            tuple(sorted((meta.get("labels") or {}).items())),
            bool(meta.get("deletionTimestamp")),
        )
        return self._changed(self._jobs, key, mark)

    def pod_changed(self, event_type: str | None, body: dict[str, Any]) -> bool:
        """A change of anything `PodState` holds (phase, scheduling, readiness, deletion, claim)."""
        uid = _meta(body).get("uid", "")
        if event_type == DELETED:
            self._pods.pop(uid, None)
            return True
        return self._changed(self._pods, uid, PodState.from_body(body, ""))

    def metastore_changed(self, event_type: str | None, body: dict[str, Any]) -> bool:
        uid = _meta(body).get("uid", "")
        if event_type == DELETED:
            self._metastores.pop(uid, None)
            return True
        ready = int((body.get("status") or {}).get("readyReplicas") or 0) >= 1
        return self._changed(self._metastores, uid, (ready, bool(_meta(body).get("deletionTimestamp"))))

    @staticmethod
    def _changed(marks: dict[Any, Any], key: Any, mark: Any) -> bool:
        if marks.get(key) == mark:
            return False
        marks[key] = mark
        return True
