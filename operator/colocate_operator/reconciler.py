"""Observe, decide, execute: the only module that reads the cluster on the job's behalf and changes it.

Every pass reads the job and its children fresh from the API server (never from a cache that may lag
behind our own last write), calls the pure `decide`, applies the plan and writes status in one merge patch
guarded by the job's resourceVersion. Passes for one job never overlap: callers (kopf handlers, the resync
thread, requeue timers) go through `reconcile`, which serialises per job and coalesces callers that arrive
while a pass is already waiting.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from colocate_operator import gpus, kube, kube_events, metrics, names
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import API_VERSION, COMPONENT_WORKER, KIND
from colocate_operator.decide import EventSpec, Plan, decide, status_patch
from colocate_operator.observed import ClaimState, Observed, PodState
from colocate_operator.spec import ColocateJob

log = logging.getLogger("colocate_operator.reconciler")
EVENT_REPEAT_SECONDS = 300.0  # a failure that persists is re-posted as an Event at most this often


def utcnow() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass
class _Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: bool = False
    timer: threading.Timer | None = None
    timer_due: float = 0.0


@dataclass
class Stats:
    passes: int = 0
    errors: int = 0
    last_pass: float = 0.0


class Reconciler:
    def __init__(
        self, api: kube.Kube, config: OperatorConfig, *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self.stats = Stats()
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._slots_lock = threading.Lock()
        self._instance = socket.gethostname()
        self._failure_events: dict[tuple[str, str, str, str, int], float] = {}

    # Periodic resync -------------------------------------------------------------------------------------

    def known_jobs(self) -> list[tuple[str, str]]:
        with self._slots_lock:
            return list(self._slots)

    def resync_forever(self, interval: float, stop: threading.Event, workers: int = 4) -> None:
        """The level-based safety net: every `interval`, one pass over every job this process has seen.

        One thread for all jobs instead of kopf's per-object timers: those make kopf put a finalizer on
        every job, and a finalizer blocks deleting a job while the operator is down.
        """
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resync") as pool:
            while not stop.wait(interval):
                for key in self.known_jobs():
                    pool.submit(self.reconcile, *key)

    # Serialisation ---------------------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        """Run one pass for the job, unless another caller is already queued to run one after the current."""
        key = (namespace, name)
        with self._slots_lock:
            slot = self._slots.setdefault(key, _Slot())
            if slot.waiting:
                return  # that queued pass will read everything this caller would have
            slot.waiting = True
        with slot.lock:
            with self._slots_lock:
                slot.waiting = False
            try:
                requeue = self._pass(namespace, name)
            except Exception:
                self.stats.errors += 1
                metrics.RECONCILE_ERRORS.inc()
                log.exception("reconcile failed", extra={"job": f"{namespace}/{name}"})
                requeue = 5.0
            self.stats.passes += 1
            self.stats.last_pass = time.time()
        if requeue is None:
            return
        if requeue < 0:  # the job is gone
            with self._slots_lock:
                if not slot.waiting and self._slots.get(key) is slot:
                    del self._slots[key]
            metrics.forget_job(namespace, name)
            return
        self._schedule(key, slot, requeue)

    def _schedule(self, key: tuple[str, str], slot: _Slot, delay: float) -> None:
        due = time.monotonic() + delay
        with self._slots_lock:
            if slot.timer is not None and slot.timer.is_alive() and slot.timer_due <= due:
                return  # an earlier requeue is pending already
            if slot.timer is not None:
                slot.timer.cancel()
            timer = threading.Timer(delay, self.reconcile, args=key)
            timer.daemon = True
            slot.timer, slot.timer_due = timer, due
            timer.start()

    # One pass --------------------------------------------------------------------------------------------

    def _pass(self, namespace: str, name: str) -> float | None:
        """Seconds until the next pass is needed; None: on the next event or timer; -1: the job is gone."""
        body = self.api.get(kube.COLOCATE_JOBS, namespace, name)
        if body is None:
            return -1.0
        if body["metadata"].get("deletionTimestamp"):
            return None  # garbage collection removes the children through their ownerReferences
        job = ColocateJob.from_body(body)
        status = body.get("status") or {}
        observed = self._observe(job, status)
        plan = decide(job, status, observed, self.clock(), self.config, secrets.token_urlsafe(32))
        return self._execute(job, body, plan)

    def _observe(self, job: ColocateJob, status: dict[str, Any]) -> Observed:
        ns, name, uid = job.ref.namespace, job.ref.name, job.ref.uid
        pods = tuple(
            PodState.from_body(p, uid)
            for p in self.api.list(kube.PODS, ns, names.label_selector(name, COMPONENT_WORKER))
        )
        children: set[str] = set()
        wanted = [(kube.SERVICES, "Service", names.headless_service(name))]
        if gpus.uses_dra(job):
            wanted.append((kube.CLAIM_TEMPLATES, "ResourceClaimTemplate", names.claim_template(name)))
        metastore_ready = False
        external_found: bool | None = None
        if job.spec.meta_store.mode == "Managed":
            wanted += [
                (kube.SECRETS, "Secret", names.metastore_secret(name)),
                (kube.SERVICES, "Service", names.metastore(name)),
                (kube.NETWORK_POLICIES, "NetworkPolicy", names.metastore(name)),
            ]
            deployment = self.api.get(kube.DEPLOYMENTS, ns, names.metastore(name))
            if deployment is not None and _is_owned(deployment, uid):
                children.add(f"Deployment/{names.metastore(name)}")
                metastore_ready = int((deployment.get("status") or {}).get("readyReplicas") or 0) >= 1
        else:
            external_found = self._external_secret_found(job)
        for kind, kind_name, child in wanted:
            # Metadata only: existence and owner are all we need, and a Secret's data never enters memory.
            meta = self.api.get(kind, ns, child, metadata_only=True)
            if meta is not None and _is_owned(meta, uid):
                children.add(f"{kind_name}/{child}")
        device_class_found: bool | None = None
        if gpus.uses_dra(job) and not status.get("groupCreated") and not job.spec.suspend:
            device_class_found = self._device_class_found(job.spec.gpu.device_class_name)
        claims: dict[str, ClaimState] = {}
        wanted_claims = {p.claim for p in pods if p.claim}
        if wanted_claims:
            for body in self.api.list(kube.CLAIMS, ns):
                if body["metadata"]["name"] in wanted_claims:
                    claim = ClaimState.from_body(body)
                    claims[claim.name] = claim
        return Observed(
            pods=pods,
            children=frozenset(children),
            metastore_ready=metastore_ready,
            external_secret_found=external_found,
            device_class_found=device_class_found,
            claims=claims,
        )

    def _external_secret_found(self, job: ColocateJob) -> bool | None:
        external = job.spec.meta_store.external
        assert external is not None
        try:
            body = self.api.get(kube.SECRETS, job.ref.namespace, external.password_secret_ref.name)
        except kube.KubeError as e:
            if e.status == 403:
                return None
            raise
        # Only the key's presence is looked at; the value is dropped with `body`.
        return body is not None and external.password_secret_ref.key in (body.get("data") or {})

    def _device_class_found(self, device_class: str) -> bool | None:
        try:
            return self.api.get(kube.DEVICE_CLASSES, None, device_class, metadata_only=True) is not None
        except kube.KubeError as e:
            if e.status in (403, 404):
                return None  # no permission, or no DRA API at all: let the scheduler report it
            raise

    def _execute(self, job: ColocateJob, body: dict[str, Any], plan: Plan) -> float | None:
        ns = job.ref.namespace
        status = body.get("status") or {}
        patch = status_patch(status, plan.status)
        if plan.persist_first and patch:
            if not self._write_status(job, body, patch):
                return 0.5  # someone else wrote first: decide again from what they wrote
            patch = {}
        failed_creates = 0
        for manifest in plan.creates:
            failed_creates += not self._create(job, manifest)
        for pod in plan.deletes:
            deleted = self.api.delete(kube.PODS, ns, pod.name, uid=pod.uid)
            if deleted:
                log.info("deleted pod", extra={"job": f"{ns}/{job.ref.name}", "pod": pod.name})
        if patch and not self._write_status(job, body, patch):
            return 0.5
        for event in plan.events:
            self._post_event(body, event)
        if plan.delete_job:
            self.api.delete(kube.COLOCATE_JOBS, ns, job.ref.name, uid=job.ref.uid)
            return -1.0
        if failed_creates:
            return 5.0
        if plan.requeue_after is not None:
            return plan.requeue_after
        return None

    def _create(self, job: ColocateJob, manifest: dict[str, Any]) -> bool:
        ns, kind = job.ref.namespace, manifest["kind"]
        what = {"job": f"{ns}/{job.ref.name}", "kind": kind, "child": manifest["metadata"]["name"]}
        if kind == "Pod" and self.config.create_delay_seconds:
            time.sleep(self.config.create_delay_seconds)
        try:
            self.api.create(self.api.kind_of(manifest), ns, manifest)
        except kube.KubeError as e:
            if e.status == 409:
                return True  # made by an earlier pass, or the old one is still terminating: next pass sees it
            log.warning("create failed: %s", e, extra=what)
            key = (ns, job.ref.name, kind, manifest["metadata"]["name"], e.status)
            if time.monotonic() - self._failure_events.get(key, -EVENT_REPEAT_SECONDS) < EVENT_REPEAT_SECONDS:
                return False  # the same failure was reported recently: retried, but not re-posted
            self._failure_events[key] = time.monotonic()
            self._post_event(
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "metadata": {"name": job.ref.name, "namespace": ns, "uid": job.ref.uid},
                },
                EventSpec("Warning", "FailedToCreate", f"{kind} {manifest['metadata']['name']}: {e.message}"),
            )
            return False
        log.info("created", extra=what)
        return True

    def _write_status(self, job: ColocateJob, body: dict[str, Any], patch: dict[str, Any]) -> bool:
        resource_version = body["metadata"].get("resourceVersion")
        try:
            self.api.patch(
                kube.COLOCATE_JOBS,
                job.ref.namespace,
                job.ref.name,
                {"metadata": {"resourceVersion": resource_version}, "status": patch},
                subresource="status",
            )
        except kube.KubeError as e:
            if e.status in (404, 409):
                return False
            raise
        metrics.STATUS_WRITES.labels("reconciler").inc()
        if "restarts" in patch:
            metrics.RESTARTS.labels(job.ref.namespace, job.ref.name).set(patch["restarts"])
        changed = sorted(patch)
        log.info(
            "status updated",
            extra={
                "job": f"{job.ref.namespace}/{job.ref.name}",
                "fields": changed,
                "phase": patch.get("phase"),
            },
        )
        return True

    def _post_event(self, body: dict[str, Any], event: EventSpec) -> None:
        kube_events.post_event(self.api, body, event.type, event.reason, event.message)


def _is_owned(body: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (body.get("metadata") or {}).get("ownerReferences") or [])
