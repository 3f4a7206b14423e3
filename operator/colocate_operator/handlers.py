"""kopf wiring, deliberately thin: every trigger just asks the Reconciler for a pass over one job.

Triggers: resume (operator start), create, spec update, watch events of the job's pods and Redis Deployment
(prompt reaction to failures and readiness), a job whose IPC preflight failed in Fail mode (IPCReady is
written by the step consumer), and a periodic resync of every known job (the level-based
safety net; one operator-wide thread, see Reconciler.resync_forever). No handler needs a finalizer, so
deleting a job never waits for the operator: garbage collection removes the children.
All handlers are sync functions: kopf runs them in its thread pool, so the blocking HTTP client never
stalls the event loop. They return None, so nothing lands in status.
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
    Phase,
)
from colocate_operator.decide import ipc_preflight_failure
from colocate_operator.kube import Kube
from colocate_operator.reconciler import Reconciler
from colocate_operator.spec import ColocateJob

JOB = (GROUP, VERSION, PLURAL)
_ROUTINE = re.compile(r"^Handler '(pod|metastore|ipc-preflight)' succeeded\.$")


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
        # Handler progress in annotations under our prefix; status is ours and pruned by the schema anyway.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=KOPF_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{KOPF_PREFIX}/kopf-finalizer"  # unused: nothing requires one
        settings.execution.max_workers = 16
        settings.networking.connect_timeout = 10
        logging.getLogger("kopf.objects").addFilter(_DropRoutineSuccess())
        memo.reconciler = Reconciler(kube or Kube.from_environment(), config)
        memo.resync_stop = threading.Event()
        threading.Thread(
            target=memo.reconciler.resync_forever,
            name="resync",
            daemon=True,
            args=(config.reconcile_interval_seconds, memo.resync_stop),
        ).start()

    @kopf.on.cleanup(id="stop-resync", registry=registry)
    def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        memo.resync_stop.set()

    @kopf.on.resume(*JOB, id="resume", registry=registry)
    @kopf.on.create(*JOB, id="create", registry=registry)
    @kopf.on.update(*JOB, id="update", field="spec", registry=registry)
    def reconcile_on_change(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.reconcile(namespace, name)

    @kopf.on.event(
        "v1",
        "pods",
        id="pod",
        labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: COMPONENT_WORKER},
        registry=registry,
    )
    def pod_changed(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.reconcile(namespace, labels[LABEL_JOB])

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        id="metastore",
        labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: COMPONENT_METASTORE},
        registry=registry,
    )
    def metastore_changed(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.reconcile(namespace, labels[LABEL_JOB])

    @kopf.on.event(*JOB, id="ipc-preflight", registry=registry)
    def ipc_preflight_changed(
        event: dict[str, Any], body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any
    ) -> None:
        # IPCReady is written by the step consumer, not through the spec: in Fail mode, fail the job at once
        # rather than at the next resync.
        status = dict(body.get("status") or {})
        if (
            event.get("type") == "DELETED"
            or status.get("phase") in Phase.TERMINAL
            or "reconciler" not in memo
        ):
            return
        job = ColocateJob.from_body(dict(body))
        if ipc_preflight_failure(job, status) is not None:
            memo.reconciler.reconcile(namespace, name)

    stepwatch.register(registry, config)

    @kopf.on.probe(id="reconciles", registry=registry)
    def reconciles(memo: kopf.Memo, **_: Any) -> dict[str, float]:
        stats = memo.reconciler.stats
        return {"passes": stats.passes, "errors": stats.errors, "lastPass": stats.last_pass}
