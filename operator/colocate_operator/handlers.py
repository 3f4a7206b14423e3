"""kopf wiring, deliberately thin: every trigger only queues the job's key for the Reconciler's workers.

Job events also feed the watch-fed indexes a pass reads (indexes.py); worker pods come through their own
watch (podwatch.py), which feeds the pod index and queues the job.
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

import asyncio
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import kopf

from colocate_operator import gang, leader, stepwatch
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
)
from colocate_operator.kube import Kube
from colocate_operator.marks import EventMarks, ipc_preflight_failed
from colocate_operator.podwatch import WORKER_SELECTOR, PodWatch
from colocate_operator.reconciler import Reconciler

JOB = (GROUP, VERSION, PLURAL)
# A job's pods change together (created, scheduled, started, ready in waves of numNodes events): one pass
# for each wave instead of one per event. Bounds how late a pod failure is acted on.
CHILD_EVENT_BATCH_SECONDS = 0.5
_ROUTINE = re.compile(r"^Handler '(job|pod|metastore|steps|workload)' succeeded\.$")


class EventOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf deep-copies every watched object on every event to build the "essence" its create/update
    handlers diff against: a fifth of the operator's CPU at 250 jobs (profiled), most of it pod bodies. This
    operator registers event handlers only, which never look at that diff, so the essence stays empty."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None  # nothing is ever stored: no annotation to look up on every event


class _DropRoutineSuccess(logging.Filter):
    """kopf logs every watched pod (and job) event as "succeeded" at INFO; with many jobs that is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and _ROUTINE.match(str(record.msg)))


# The selector of the watches on what a job's worker pods bring along (their Kueue Workload).
WORKER_PODS = {LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: COMPONENT_WORKER}
# The same selections as label selectors of kopf's watch requests themselves (the handlers keep theirs).
SERVER_SIDE_SELECTORS = {
    ("apps", "v1", "deployments"): f"{LABEL_JOB},{LABEL_COMPONENT}={COMPONENT_METASTORE}",
    ("kueue.x-k8s.io", "v1beta2", "workloads"): WORKER_SELECTOR,
}


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf's settings for this operator (a startup handler applies them)."""
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
    # The API server filters the child watches to what the handlers below select: kopf would otherwise
    # receive, parse and dispatch every pod (Deployment, Workload) of the watched namespaces.
    for resource, selector in SERVER_SIDE_SELECTORS.items():
        settings.watching.label_selectors[resource] = selector


def register(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    kube: Kube | None = None,
    namespaces: Sequence[str] = (),
    election: leader.Settings | None = None,
) -> None:
    """Register the handlers on `registry`; `kube` defaults to the environment's credentials at startup;
    `namespaces`: kopf's namespace patterns (none: cluster-wide), which the worker pods' watch follows too.
    `election`: run as one of several replicas (leader.py): everything that writes (the reconcile workers,
    the resync, the pod watch, the step followers) starts only once this replica leads; a standby only
    keeps its job index warm from kopf's watch."""
    _register_lifecycle(registry, config, kube, namespaces, election)
    _register_job_events(registry)
    _register_child_events(registry)
    stepwatch.register(registry, config, kube, watch_jobs=False)  # job_event calls job_seen
    _register_probe(registry)


def _register_lifecycle(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    kube: Kube | None,
    namespaces: Sequence[str],
    election: leader.Settings | None,
) -> None:
    """Startup (the reconciler, then leading at once or once elected) and cleanup (the workers stop)."""

    @kopf.on.startup(id="event-loop", registry=registry)
    async def remember_loop(memo: kopf.Memo, **_: Any) -> None:
        memo.loop = asyncio.get_running_loop()  # a new leader starts its step followers on it

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings)
        logging.getLogger("kopf.objects").addFilter(_DropRoutineSuccess())
        api = kube or Kube.from_environment()
        memo.reconciler = Reconciler(api, gang.discover(api, config))
        memo.marks = EventMarks()
        memo.stop = threading.Event()
        memo.leading = threading.Event()
        memo.workers = []
        if election is None:
            _lead(memo, api, config, namespaces)
            return
        memo.elector = leader.LeaderElector(
            api, election, lambda: _lead(memo, api, config, namespaces), _lost_lead
        )
        memo.elector.start(memo.stop)

    @kopf.on.cleanup(id="stop-workers", registry=registry)
    def stop_workers(memo: kopf.Memo, **_: Any) -> None:
        memo.stop.set()
        memo.reconciler.queue.close()
        if "elector" in memo:  # the passes in flight end first, then the standby may take over at once
            for worker in memo.workers:
                worker.join(timeout=5)
            memo.elector.release()


def _register_job_events(registry: kopf.OperatorRegistry) -> None:
    # The one handler of job events: the reconciler's index and queue, then the job's step follower (kopf's
    # per-handler machinery costs about as much as the handler's own work, so one call, not two).
    @kopf.on.event(*JOB, id="job", registry=registry)
    async def job_event(event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        body = event.get("object") or {}
        if "reconciler" in memo:
            memo.reconciler.indexes.ready = True  # the pod index also waits for podwatch's first listing
            if event.get("type") == "DELETED":
                memo.reconciler.indexes.job_gone(namespace, name, (body.get("metadata") or {}).get("uid", ""))
            else:
                memo.reconciler.indexes.saw_job(body)
            if memo.marks.job_changed(event.get("type"), namespace, name, body) or ipc_preflight_failed(body):
                memo.reconciler.enqueue(namespace, name)
        if "leading" in memo and memo.leading.is_set():
            stepwatch.job_seen(memo, event.get("type"), body, namespace, name)


def _register_child_events(registry: kopf.OperatorRegistry) -> None:
    """The job's Redis Deployment and its Kueue Workload: a change a decision reads queues the job."""

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

    # A queued job's Workload (kueue.py): Kueue admitting or evicting it is the job's cue. Without Kueue's
    # CRDs kopf serves nothing here (it logs that once) and picks the resource up when they appear.
    @kopf.on.event(
        "kueue.x-k8s.io",
        "v1beta2",
        "workloads",
        id="workload",
        labels=WORKER_PODS,
        registry=registry,
    )
    async def workload_event(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
        if "reconciler" in memo:
            memo.reconciler.enqueue(namespace, labels[LABEL_JOB], delay=CHILD_EVENT_BATCH_SECONDS)


def _register_probe(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.probe(id="reconciles", registry=registry)
    def reconciles(memo: kopf.Memo, **_: Any) -> dict[str, float]:
        stats = memo.reconciler.stats
        leading = float(memo.leading.is_set())
        return {
            "passes": stats.passes,
            "errors": stats.errors,
            "lastPass": stats.last_pass,
            "leading": leading,
        }


def _lead(memo: kopf.Memo, api: Kube, config: OperatorConfig, namespaces: Sequence[str]) -> None:
    """Start everything that writes: this replica leads (or runs alone)."""
    memo.leading.set()
    # The worker pods' own watch (podwatch.py, not kopf's: its per-event machinery was most of the cost).
    # Made before the workers start: until its first listing, passes read the pods from the API server (a
    # standby watched none, and an empty pod index read as "every pod disappeared" would restart groups).
    memo.pod_watch = PodWatch(
        api,
        memo.reconciler.indexes,
        lambda ns, job: memo.reconciler.enqueue(ns, job, delay=CHILD_EVENT_BATCH_SECONDS),
        namespaces,
    )
    memo.workers = memo.reconciler.start_workers(config.reconcile_workers, memo.stop)
    memo.pod_watch.start(memo.stop)
    threading.Thread(
        target=memo.reconciler.resync_forever,
        name="resync",
        daemon=True,
        args=(config.reconcile_interval_seconds, memo.stop),
    ).start()
    # Jobs kopf showed while this replica stood by: queued already (job_event), their followers start now.
    loop = memo.get("loop")
    if loop is not None and "step_watchers" in memo:
        loop.call_soon_threadsafe(_follow_all, memo)


def _follow_all(memo: kopf.Memo) -> None:
    for body in memo.reconciler.indexes.job_bodies():
        meta = body.get("metadata") or {}
        stepwatch.job_seen(memo, "MODIFIED", body, meta.get("namespace", ""), meta.get("name", ""))


def _lost_lead() -> None:
    """Another replica may lead already: stop every write at once, as client-go's callers do (the pod's
    restart makes this replica a standby again)."""
    logging.getLogger("colocate_operator").error("lost the leader lease: exiting")
    logging.shutdown()
    os._exit(1)
