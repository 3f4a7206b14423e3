"""kopf wiring, deliberately thin: every trigger only queues the job's key for the Reconciler's workers.

Triggers: watch events of the job (first sight, including the operator's start, and changes of its spec
or labels), of its pods and of its Redis Deployment (only when something a decision reads changed: phase,
readiness, scheduling, deletion), a job whose IPC preflight failed in Fail mode (IPCReady is written by the
step consumer), and a periodic resync of every known job (the level-based safety net; one operator-wide
thread, see Reconciler.resync_forever). The handlers are async and never wait on the API server, so a burst
of pod events cannot occupy kopf's workers. Only event handlers: kopf writes nothing to the job (no
progress annotations, no finalizer), so deleting a job never waits for the operator and a new job costs
no extra patch.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import kopf

from colocate_operator import stepwatch
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    COMPONENT_METASTORE,
    COMPONENT_WORKER,
    GROUP,
    KOPF_PREFIX,
    LABEL_COMPONENT,
    LABEL_JOB,
    OPERATOR_NAME,
    PLURAL,
    VERSION,
    Cond,
    Phase,
)
from colocate_operator.decide import ipc_preflight_failure
from colocate_operator.kube import Kube
from colocate_operator.marks import EventMarks
from colocate_operator.reconciler import Reconciler
from colocate_operator.spec import ColocateJob

JOB = (GROUP, VERSION, PLURAL)
# A job's pods change together (created, scheduled, started, ready in waves of numNodes events): one pass
# for each wave instead of one per event. Bounds how late a pod failure is acted on.
CHILD_EVENT_BATCH_SECONDS = 0.5
_ROUTINE = re.compile(r"^Handler '(job|pod|metastore|steps)' succeeded\.$")


class EventOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf deep-copies every watched object on every event to build the "essence" its create/update
    handlers diff against: a fifth of the operator's CPU at 250 jobs (profiled), most of it pod bodies. This
    operator registers event handlers only, which never look at that diff, so the essence stays empty."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


class _DropRoutineSuccess(logging.Filter):
    """kopf logs every watched pod (and job) event as "succeeded" at INFO; with many jobs that is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and _ROUTINE.match(str(record.msg)))


def register(registry: kopf.OperatorRegistry, config: OperatorConfig, kube: Kube | None = None) -> None:
    """Register the handlers on `registry`; `kube` defaults to the environment's credentials at startup."""

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # kopf's own log lines must not become Events; the reconciler posts its lifecycle Events itself.
        settings.posting.level = logging.WARNING
        settings.posting.loggers = False
        settings.posting.reporting_component = OPERATOR_NAME
        # Nothing is stored by kopf today (event handlers only); should that change, under our prefix.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
        settings.persistence.diffbase_storage = EventOnlyDiffBase(
            prefix=KOPF_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{KOPF_PREFIX}/kopf-finalizer"  # unused: nothing requires one
        settings.networking.connect_timeout = 10
        logging.getLogger("kopf.objects").addFilter(_DropRoutineSuccess())
        memo.reconciler = Reconciler(kube or Kube.from_environment(), config)
        memo.marks = EventMarks()
        memo.stop = threading.Event()
        memo.reconciler.start_workers(config.reconcile_workers, memo.stop)
        threading.Thread(
            target=memo.reconciler.resync_forever,
            name="resync",
            daemon=True,
            args=(config.reconcile_interval_seconds, memo.stop),
        ).start()

    @kopf.on.cleanup(id="stop-workers", registry=registry)
    def stop_workers(memo: kopf.Memo, **_: Any) -> None:
        memo.stop.set()
        memo.reconciler.queue.close()

    @kopf.on.event(*JOB, id="job", registry=registry)
    async def job_event(event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        if "reconciler" not in memo:
            return
        body = event.get("object") or {}
        if memo.marks.job_changed(event.get("type"), namespace, name, body) or _ipc_preflight_failed(body):
            memo.reconciler.enqueue(namespace, name)

    @kopf.on.event(
        "v1",
        "pods",
        id="pod",
        labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: COMPONENT_WORKER},
        registry=registry,
    )
    async def pod_event(
        event: dict[str, Any], labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any
    ) -> None:
        if "reconciler" in memo and memo.marks.pod_changed(event.get("type"), event.get("object") or {}):
            memo.reconciler.enqueue(namespace, labels[LABEL_JOB], delay=CHILD_EVENT_BATCH_SECONDS)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        id="metastore",
        labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: COMPONENT_METASTORE},
        registry=registry,
    )
    async def metastore_event(
        event: dict[str, Any], labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any
    ) -> None:
        changed = "reconciler" in memo and memo.marks.metastore_changed(
            event.get("type"), event.get("object") or {}
        )
        if changed:
            memo.reconciler.enqueue(namespace, labels[LABEL_JOB], delay=CHILD_EVENT_BATCH_SECONDS)

    stepwatch.register(registry, config)

    @kopf.on.probe(id="reconciles", registry=registry)
    def reconciles(memo: kopf.Memo, **_: Any) -> dict[str, float]:
        stats = memo.reconciler.stats
        return {"passes": stats.passes, "errors": stats.errors, "lastPass": stats.last_pass}


def _ipc_preflight_failed(body: dict[str, Any]) -> bool:
    """IPCReady is written by the step consumer, not through the spec: in Fail mode, fail the job at once
    rather than at the next resync. The cheap test first: most events carry no failed IPCReady."""
    status = body.get("status") or {}
    if status.get("phase") in Phase.TERMINAL or not any(
        c.get("type") == Cond.IPC_READY and c.get("status") == "False" for c in status.get("conditions") or []
    ):
        return False
    return ipc_preflight_failure(ColocateJob.from_body(body), status) is not None
