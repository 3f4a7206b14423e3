"""Observe, decide, execute: the only module that reads the cluster on the job's behalf and changes it.

A pass takes the job and its pods from the watch-fed indexes (`indexes.py`) when they show every write of
this process's earlier passes, and reads them from the API server otherwise (and once per resync interval);
it calls the pure `decide`, applies the plan and writes status in one merge patch guarded by the job's
resourceVersion. Children that exist and facts that cannot change (`known.py`) are not read again until the
resync interval has passed. Watch handlers, the resync thread and requeues only add the job's key
to a deduplicating work queue; a fixed set of worker threads runs the passes, never two for one job at once.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from colocate_operator import (
    checkpoints,
    children,
    gpus,
    kube,
    kube_events,
    metrics,
    names,
    resync,
    workloads,
)
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    API_VERSION,
    COMPONENT_METASTORE,
    COMPONENT_WORKER,
    KIND,
    SECRET_FORMAT,
    SECRET_FORMAT_ANNOTATION,
    Phase,
    Reason,
)
from colocate_operator.decide import EventSpec, Plan, create_backoff, decide
from colocate_operator.indexes import Indexes
from colocate_operator.known import KnownFacts
from colocate_operator.observed import (
    ClaimState,
    CreateRefusal,
    ForeignChild,
    Observed,
    PodState,
    StreamProgress,
)
from colocate_operator.secret_reads import SecretReads
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView, final_step_recorded, status_patch, without
from colocate_operator.workqueue import WorkQueue

log = logging.getLogger("colocate_operator.reconciler")
EVENT_REPEAT_SECONDS = 300.0  # a failure that persists is re-posted as an Event at most this often
ERROR_RETRY_SECONDS = 5.0
CHECKPOINT_RETRY_SECONDS = 5.0  # a checkpoint write still on its way: the pass comes back at the latest then
# How long a pod's exit waits for the step follower to read the stream to its end before it may count as
# an exit without the final record (a restart). Past it, the exit is judged without that answer.
FINAL_RECORD_WAIT_SECONDS = 60.0

JobKey = tuple[str, str]  # (namespace, name)


class Gone:
    """A pass's outcome when the job no longer exists (or the pass deleted it): forget it, queue nothing."""


GONE = Gone()
CREATED, TAKEN, FAILED = "created", "taken", "failed"  # outcomes of one create


def utcnow() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


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
        self.queue: WorkQueue[JobKey] = WorkQueue()
        self.known = KnownFacts(max_age=config.reconcile_interval_seconds)
        self.indexes = Indexes(max_age=config.reconcile_interval_seconds)
        # Shared with the step followers when they start (StepWatchers.secret_reads).
        self.secret_reads = SecretReads(max_age=config.reconcile_interval_seconds)
        self._uids: dict[JobKey, str] = {}  # jobs this process has seen, for the resync
        self._jobs_lock = threading.Lock()
        self._instance = socket.gethostname()
        self._failure_events: dict[tuple[str, str, str, str, int], float] = {}
        self._outdated_secrets: set[str] = set()  # jobs told their Secret predates the worker user
        self._creators = ThreadPoolExecutor(max_workers=8, thread_name_prefix="create")
        # A job's meta-store is read and written on threads of its own, never on these workers: a store one
        # job paused or slowed holds back only that job (checkpoints.py).
        self.checkpoint_io = checkpoints.CheckpointIO(api, config, on_done=self.enqueue)
        # The step followers' read progress (StepWatchers.stream_progress), wired when they start.
        self.stream_progress: Callable[[str, str], StreamProgress | None] | None = None
        self._exits_seen: dict[
            str, float
        ] = {}  # job uid -> when a pod exit awaiting the final record was seen
        # job uid -> kind -> its creates refused in a row, until one succeeds (the pass backs off on them:
        # pod_gate.py, decision.py).
        self._refusals: dict[str, dict[str, CreateRefusal]] = {}
        self._refusals_lock = threading.Lock()

    # Entry points ----------------------------------------------------------------------------------------

    def enqueue(self, namespace: str, name: str, delay: float = 0.0) -> None:
        """Ask for a pass over the job within `delay` seconds; returns at once (thread-safe, callable from
        the event loop). Events arriving within the delay share one pass."""
        self.queue.add_after((namespace, name), delay)

    def known_jobs(self) -> list[JobKey]:
        with self._jobs_lock:
            return list(self._uids)

    def start_workers(self, count: int, stop: threading.Event) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._work, args=(stop,), name=f"reconcile-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in threads:
            thread.start()
        return threads

    def _work(self, stop: threading.Event) -> None:
        while not stop.is_set():
            key = self.queue.get(timeout=1.0)  # wakes once a second to notice `stop`
            if key is None:
                continue
            try:
                self.reconcile(*key)
            finally:
                self.queue.done(key)

    def resync_forever(self, interval: float, stop: threading.Event) -> None:
        """The level-based safety net: every `interval`, every job this process has seen is queued.

        One thread for all jobs instead of kopf's per-object timers: those make kopf put a finalizer on
        every job, and a finalizer blocks deleting a job while the operator is down.
        """
        while not stop.wait(interval):
            self.resync_once()

    def resync_once(self) -> None:
        """Refresh every known job's view with a few lists per namespace (resync.py), then queue them all."""
        with self._jobs_lock:
            jobs = dict(self._uids)
        sent = resync.refresh(self.api, self.indexes, self.known, jobs)
        log.debug("resync: %d list requests for %d jobs", sent, len(jobs))
        for key in jobs:
            self.enqueue(*key)

    def reconcile(self, namespace: str, name: str) -> None:
        """One pass now, in the calling thread (workers call this; so do tests)."""
        key = (namespace, name)
        try:
            requeue = self._pass(namespace, name)
        except Exception:
            self.stats.errors += 1
            metrics.RECONCILE_ERRORS.inc()
            log.exception("reconcile failed", extra={"job": f"{namespace}/{name}"})
            requeue = ERROR_RETRY_SECONDS
        self.stats.passes += 1
        self.stats.last_pass = time.time()
        if requeue is None:
            return
        if isinstance(requeue, Gone):
            with self._jobs_lock:
                uid = self._uids.pop(key, None)
            if uid is not None:
                self.known.forget(uid)
                self._exits_seen.pop(uid, None)
                with self._refusals_lock:
                    self._refusals.pop(uid, None)
            self.checkpoint_io.forget(namespace, name)
            self.indexes.forget(namespace, name)
            self.queue.forget(key)
            metrics.forget_job(namespace, name)
            return
        self._schedule(key, requeue)

    def _schedule(self, key: JobKey, delay: float) -> None:
        self.queue.add_after(key, delay)

    # One pass --------------------------------------------------------------------------------------------

    def _pass(self, namespace: str, name: str) -> float | Gone | None:
        """Seconds until the next pass is needed; None: on the next event or timer; GONE: forget the job."""
        body = self.indexes.job(namespace, name)
        if body is None:
            body = self.api.get(kube.COLOCATE_JOBS, namespace, name)
            if body is not None:
                self.indexes.read_job(body)
        if body is None:
            return GONE
        if body["metadata"].get("deletionTimestamp"):
            return None  # garbage collection removes the children through their ownerReferences
        job = ColocateJob.from_body(body)
        with self._jobs_lock:
            previous = self._uids.get((namespace, name))
            self._uids[(namespace, name)] = job.ref.uid
        if previous is not None and previous != job.ref.uid:
            self.known.forget(previous)  # re-created under the same name
        status = body.get("status") or {}
        observed = self._final_record(job, status, self._observe(job, status))
        observed = workloads.observe(self.api, job, observed)  # a job Kueue queues: its Workload
        observed = self.checkpoint_io.observe(job, status, observed)  # while a suspend waits
        with self._refusals_lock:
            refusals = tuple((self._refusals.get(job.ref.uid) or {}).values())
        observed = replace(observed, create_refusals=refusals)
        now = self.clock()
        plan = decide(job, status, observed, now, self.config, secrets.token_urlsafe(32))
        workloads.write(self.api, job, observed, plan, now)
        return self._execute(job, body, plan)

    def _observe(self, job: ColocateJob, status: dict[str, Any]) -> Observed:
        """What exists of the job: its pods, its children (the table in children.py), their facts."""
        pods = self._pods(job)
        found = _Found(conflicts=self.known.conflicts(job.ref.uid))
        table = children.of(job, self.config)
        whole = [self._read_whole(job, status, c, found) for c in table if c.read == children.Read.WHOLE]
        metastore_ready = any(whole)  # the Redis Deployment is the one child read whole
        external_found = None if job.spec.meta_store.mode == "Managed" else self._external_secret_found(job)
        self._read_children(job, status, table, found)
        self._read_pod_conflicts(job, pods, found)
        device_class_found: bool | None = None
        if gpus.uses_dra(job) and not StatusView(status).group_created and not job.spec.suspend:
            device_class_found = self._device_class_found(job.spec.gpu.device_class_name)
        return Observed(
            pods=pods,
            children=frozenset(found.children),
            foreign=tuple(found.foreign),
            metastore_pods=self._metastore_pods(job, found),
            metastore_ready=metastore_ready,
            external_secret_found=external_found,
            device_class_found=device_class_found,
            claims=self._claims(job, pods),
        )

    def _pods(self, job: ColocateJob) -> tuple[PodState, ...]:
        ns, name, uid = job.ref.namespace, job.ref.name, job.ref.uid
        pods = self.indexes.pods(ns, name, uid)
        if pods is None:
            items, at = self.api.list_at(kube.PODS, ns, names.label_selector(name, COMPONENT_WORKER))
            pods = tuple(PodState.from_body(p, uid) for p in items)
            self.indexes.read_pods(ns, name, items, at)
        return pods

    def _read_whole(
        self, job: ColocateJob, status: dict[str, Any], child: children.Child, found: _Found
    ) -> bool:
        """A child read whole on every pass (the Redis Deployment): whether it is ours and ready.

        A job no pass has written status for is new: its children exist only if an operator died between
        creating them and writing status. Create without looking first; a 409 means it exists, and the next
        pass reads it (saves a read per child, and a 404 in the API server's error counts)."""
        uid, key = job.ref.uid, child.key
        body = None if not status and key not in found.conflicts else self._get(job, child)
        ready = False
        if body is not None and _is_owned(body, uid):
            found.children.add(key)
            ready = int((body.get("status") or {}).get("readyReplicas") or 0) >= 1
        elif body is not None:
            found.foreign.append(ForeignChild.from_body(key, body))
        if key in found.conflicts and (body is None or key in found.children):
            self.known.resolved(uid, key)
        return ready

    def _read_children(
        self, job: ColocateJob, status: dict[str, Any], table: tuple[children.Child, ...], found: _Found
    ) -> None:
        """Existence and owner of the children read by metadata, unless remembered. Names a create found
        taken (409) are read until they are ours or gone; an object of a child's name that is not the job's
        becomes a condition (ForeignChild), never counts as the child."""
        uid = job.ref.uid
        known = self.known.children(uid)
        seen: set[str] = set()
        ran = StatusView(status).phase == Phase.RUNNING
        for child in table:
            key = child.key
            if child.read in (children.Read.WHOLE, children.Read.ELSEWHERE):
                continue
            if key in known and key not in found.conflicts:
                found.children.add(key)
                continue
            # The budget is wanted only once the gang is ready (children.py): before the job last ran, it
            # is not read (a 404 on every pass of a bring-up) but created without looking, as a new job's
            # children are.
            unread = not status or (child.read == children.Read.ONCE_RAN and not ran)
            if unread and key not in found.conflicts:
                continue
            # Metadata only: existence and owner are all we need, and a Secret's data never enters memory.
            meta = self._get(job, child, metadata_only=True)
            if meta is not None and _is_owned(meta, uid):
                seen.add(key)
                if _outdated_secret(child, meta):
                    self._report_outdated_secret(job, meta)
            elif meta is not None:
                found.foreign.append(ForeignChild.from_body(key, meta))
            if key in found.conflicts and key not in {f.key for f in found.foreign}:
                self.known.resolved(uid, key)
        found.children |= seen
        self.known.saw_children(uid, seen)

    def _report_outdated_secret(self, job: ColocateJob, meta: dict[str, Any]) -> None:
        """A Managed Secret from before the worker user (no `worker-password`): the pods' containers cannot
        start. The chart grants no `delete` on Secrets (least privilege), so the user deletes it, once; the
        operator then makes a new one and restarts Redis and the pods on it (MetaStorePasswordChanged). Said
        once per job and operator process."""
        if job.ref.uid in self._outdated_secrets:
            return
        self._outdated_secrets.add(job.ref.uid)
        name, ns = meta["metadata"]["name"], job.ref.namespace
        self._post_event(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {"name": job.ref.name, "namespace": ns, "uid": job.ref.uid},
            },
            EventSpec(
                "Warning",
                Reason.META_STORE_SECRET_OUTDATED,
                f"Secret {name} predates the pods' Redis user (it has no worker-password key), so their "
                f"containers cannot start: delete it (kubectl delete secret {name} -n {ns}) and the operator "
                "makes a new one and restarts Redis and the pods on it",
            ),
        )

    def _get(
        self, job: ColocateJob, child: children.Child, *, metadata_only: bool = False
    ) -> dict[str, Any] | None:
        kind = self.api.kind_of({"apiVersion": child.api_version, "kind": child.kind})
        if metadata_only:
            return self.api.get(kind, job.ref.namespace, child.name, metadata_only=True)
        return self.api.get(kind, job.ref.namespace, child.name)

    def _read_pod_conflicts(self, job: ColocateJob, pods: tuple[PodState, ...], found: _Found) -> None:
        """A pod name a create found taken: someone else's pod, or ours (resolved)."""
        uid = job.ref.uid
        for key in sorted(c for c in found.conflicts if c.startswith("Pod/")):
            pod_name = key.removeprefix("Pod/")
            meta = (
                None
                if any(p.name == pod_name and p.owned for p in pods)
                else self.api.get(kube.PODS, job.ref.namespace, pod_name, metadata_only=True)
            )
            if meta is not None and not _is_owned(meta, uid):
                found.foreign.append(ForeignChild.from_body(key, meta))
            else:
                self.known.resolved(uid, key)

    def _metastore_pods(self, job: ColocateJob, found: _Found) -> tuple[tuple[str, str], ...]:
        """This job's Redis runs but its Secret is gone (deleted behind our back): a new Secret means a new
        password, so Redis must restart on it too (decide.py); its pods are the only ones read for that."""
        secret_key = children.secret_key(job)
        if (
            children.deployment_key(job) not in found.children
            or secret_key in found.children
            or any(f.key == secret_key for f in found.foreign)
        ):
            return ()
        selector = names.label_selector(job.ref.name, COMPONENT_METASTORE)
        return tuple(
            (p["metadata"]["name"], p["metadata"]["uid"])
            for p in self.api.list(kube.PODS, job.ref.namespace, selector)
        )

    def _claims(self, job: ColocateJob, pods: tuple[PodState, ...]) -> dict[str, ClaimState]:
        """Each claim by name: a namespace-wide list would grow with every other job's claims."""
        uid = job.ref.uid
        wanted_claims = {p.claim for p in pods if p.claim}
        allocated = self.known.claims(uid)
        claims = {name: allocated[name] for name in wanted_claims if name in allocated}
        for claim_name in sorted(wanted_claims - claims.keys()):
            body = self.api.get(kube.CLAIMS, job.ref.namespace, claim_name)
            if body is not None:
                claims[claim_name] = ClaimState.from_body(body)
        self.known.saw_claims(uid, claims)
        return claims

    def _final_record(self, job: ColocateJob, status: dict[str, Any], observed: Observed) -> Observed:
        """The catch-up barrier (M4): before a pod's exit counts as one without the final record, the step
        follower must have read the stream to its end after the exit was seen. The follower may lag behind
        status: a restarted operator replays the stream, a refused status write waits 10 s."""
        uid, restarts = job.ref.uid, StatusView(status).restarts
        exits = [
            pod
            for pod in observed.pods
            if pod.owned and pod.restart == restarts and pod.phase in ("Succeeded", "Failed")
        ]
        recorded = final_step_recorded(status)
        if not exits or recorded or StatusView(status).phase in Phase.TERMINAL:
            self._exits_seen.pop(uid, None)
            return observed
        now = time.time()
        since = self._exits_seen.setdefault(uid, now)
        progress = self.stream_progress(job.ref.namespace, job.ref.name) if self.stream_progress else None
        if progress is not None and progress.final:
            return replace(observed, final_record=True, final_failure=progress.final_failure)
        if progress is not None and progress.caught_up_at >= since:
            return replace(observed, final_record=False)
        # Worth waiting for: a follower that is reading (it will catch up), or any exit with code 0 (the
        # follower of a restarted operator may not have connected yet). A failed pod with no follower
        # reading is a failure at once.
        live = progress is not None and progress.caught_up_at > 0
        exited_ok = any(pod.phase == "Succeeded" for pod in exits)
        pending = now - since < FINAL_RECORD_WAIT_SECONDS and (live or exited_ok)
        return replace(observed, final_record_pending=pending)

    def _external_secret_found(self, job: ColocateJob) -> bool | None:
        external = job.spec.meta_store.external
        assert external is not None
        if not self.config.external_metastore_allow.allows(external.address):
            return None  # refused (decide says so): its Secret is not read at all
        ref = external.password_secret_ref
        fact = f"ExternalSecret/{ref.name}/{ref.key}"
        if fact in self.known.children(job.ref.uid):
            return True
        # A step follower that read the Secret moments ago answers it (one read per job, not two).
        # A read that lacked the key is not trusted: the user may have added it since (read again).
        seen = self.secret_reads.recent(job.ref.namespace, ref.name)
        if seen is None or ref.key not in seen.data:
            reads = self.secret_reads
            try:
                # No read to remember: share one in flight (jobs sharing a Secret start together).
                seen = (reads.read_shared if seen is None else reads.read)(
                    self.api, job.ref.namespace, ref.name
                )
            except kube.KubeError as e:
                if e.status == 403:
                    return None
                raise
        # Only the key's presence is looked at here; the value stays in `secret_reads` for the follower.
        found = seen is not None and ref.key in seen.data
        if found:
            self.known.saw_children(job.ref.uid, [fact])
        return found

    def _device_class_found(self, device_class: str) -> bool | None:
        try:
            return self.api.get(kube.DEVICE_CLASSES, None, device_class, metadata_only=True) is not None
        except kube.KubeError as e:
            if e.status in (403, 404):
                return None  # no permission, or no DRA API at all: let the scheduler report it
            raise

    def _execute(self, job: ColocateJob, body: dict[str, Any], plan: Plan) -> float | Gone | None:
        ns = job.ref.namespace
        status = body.get("status") or {}
        patch = status_patch(status, plan.status)
        if plan.persist_first and patch:
            if not self._write_status(job, body, patch):
                return 0.5  # someone else wrote first: decide again from what they wrote
            patch = {}
        creates, withdraw_pending = plan.creates, False
        try:
            written = self.checkpoint_io.execute(job, plan.checkpoint)  # before the resumed pods exist
        except checkpoints.CheckpointUnavailable as e:
            if plan.checkpoint is None or not plan.checkpoint.withdraw:
                raise
            written = False
            log.warning(
                "checkpoint request not withdrawn: the pods wait",
                extra={"job": f"{ns}/{job.ref.name}", "error": str(e)},
            )
            # The store may be what this plan re-creates (a Secret deleted while suspended) or what must be
            # read again: its children are read afresh by the next pass, not trusted from memory.
            for child in sorted(children.metastore_keys(job) - {children.deployment_key(job)}):
                self.known.lost_child(job.ref.uid, child)
        if not written:
            if plan.checkpoint is None or not plan.checkpoint.withdraw:
                return CHECKPOINT_RETRY_SECONDS  # its end queues the job sooner
            # A resume's withdraw that failed or is still on its way holds back the pods only (a new trainer
            # must not see the old request): the meta-store's children, deletes and status go on, else a
            # store whose Secret or Redis is missing could never be made whole again (issue 30, item 5).
            creates = tuple(m for m in plan.creates if m["kind"] != "Pod")
            withdraw_pending = True
            patch = without(patch, "phase")  # still Suspended(ing): that makes the next pass withdraw again
        failed_creates, held = self._create_all(job, creates)
        for pod in plan.deletes:
            deleted = self.api.delete(kube.PODS, ns, pod.name, uid=pod.uid)
            if deleted is not None:
                self.indexes.deleted_pod(ns, job.ref.name, pod.uid, deleted)
                log.info("deleted pod", extra={"job": f"{ns}/{job.ref.name}", "pod": pod.name})
        for pod in plan.force_deletes:
            deleted = self.api.delete(kube.PODS, ns, pod.name, uid=pod.uid, grace_seconds=0)
            if deleted is not None:
                self.indexes.deleted_pod(ns, job.ref.name, pod.uid, deleted)
                log.warning(
                    "force-deleted a pod stuck terminating",
                    extra={"job": f"{ns}/{job.ref.name}", "pod": pod.name},
                )
        if patch and not self._write_status(job, body, patch):
            return 0.5
        for event in plan.events:
            if _announces(event, held):
                continue  # held back behind a name found taken: the pass that creates it says so
            self._post_event(body, event)
        if plan.delete_job:
            self.api.delete(kube.COLOCATE_JOBS, ns, job.ref.name, uid=job.ref.uid)
            return GONE
        if failed_creates:  # the next pass holds back what was refused until its backoff ends
            with self._refusals_lock:
                attempts = min(
                    (r.attempts for r in (self._refusals.get(job.ref.uid) or {}).values()), default=1
                )
            return create_backoff(attempts)
        if withdraw_pending:
            return min(CHECKPOINT_RETRY_SECONDS, plan.requeue_after or CHECKPOINT_RETRY_SECONDS)
        if plan.requeue_after is not None:
            return plan.requeue_after
        return None

    def _create_all(self, job: ColocateJob, manifests: tuple[dict[str, Any], ...]) -> tuple[int, set[str]]:
        """Create in three waves, each in parallel: the Secret, the other children, the pods. A job's first
        pass is a dozen requests; in sequence they are most of its latency. A name found taken (409) holds
        back what depends on it: the Secret's holds back Redis (which mounts it) and the pods (which read
        it), any other child's the pods (which would dial whatever holds the meta-store's name); the next
        pass reads the name and tells our own object from someone else's. Returns the failed creates and
        the kinds held back."""
        failed = 0
        held: set[str] = set()
        created: list[str] = []
        refused: dict[str, tuple[str, str]] = {}  # kind -> (name, the API server's message)
        for number in range(3):
            wave = [m for m in manifests if _wave(m["kind"]) == number and m["kind"] not in held]
            if self.config.create_delay_seconds or len(wave) <= 1:  # fault injection: a predictable order
                outcomes = [self._create(job, m, refused) for m in wave]
            else:
                outcomes = list(self._creators.map(lambda m: self._create(job, m, refused), wave))
            failed += outcomes.count(FAILED)
            for manifest, outcome in zip(wave, outcomes, strict=True):
                if outcome == CREATED:
                    created.append(f"{manifest['kind']}/{manifest['metadata']['name']}")
                if outcome == TAKEN and manifest["kind"] == "Secret":
                    held |= {"Deployment", "Pod"}
                elif outcome == TAKEN and manifest["kind"] != "Pod":
                    held.add("Pod")
        if refused:
            self._count_refusals(job.ref.uid, refused)
        if created:  # one line per pass, not one per child (a new job makes seven)
            log.info("created", extra={"job": f"{job.ref.namespace}/{job.ref.name}", "children": created})
        return failed, held & {m["kind"] for m in manifests}

    def _create(self, job: ColocateJob, manifest: dict[str, Any], refused: dict[str, tuple[str, str]]) -> str:
        ns, kind = job.ref.namespace, manifest["kind"]
        what = {"job": f"{ns}/{job.ref.name}", "kind": kind, "child": manifest["metadata"]["name"]}
        if kind == "Pod" and self.config.create_delay_seconds:
            time.sleep(self.config.create_delay_seconds)
        try:
            created = self.api.create(self.api.kind_of(manifest), ns, manifest)
        except kube.KubeError as e:
            if e.status == 409:
                # Made by an earlier pass, or someone else's object of that name (or an old one still
                # terminating): the next passes read it and tell them apart.
                self.known.conflict(job.ref.uid, f"{kind}/{manifest['metadata']['name']}")
                return TAKEN
            log.warning("create failed: %s", e, extra=what)
            if kind not in refused or manifest["metadata"]["name"] < refused[kind][0]:  # the first by name
                refused[kind] = (manifest["metadata"]["name"], e.message)
            key = (ns, job.ref.name, kind, manifest["metadata"]["name"], e.status)
            if time.monotonic() - self._failure_events.get(key, -EVENT_REPEAT_SECONDS) < EVENT_REPEAT_SECONDS:
                return FAILED  # the same failure was reported recently: retried, but not re-posted
            self._failure_events[key] = time.monotonic()
            self._post_event(
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "metadata": {"name": job.ref.name, "namespace": ns, "uid": job.ref.uid},
                },
                EventSpec("Warning", "FailedToCreate", f"{kind} {manifest['metadata']['name']}: {e.message}"),
            )
            return FAILED
        with self._refusals_lock:
            self._refusals.get(job.ref.uid, {}).pop(kind, None)  # a success ends the backoff
        if kind == "Pod":
            self.indexes.created_pod(ns, job.ref.name, manifest["metadata"]["name"], created)
        else:
            self.known.saw_children(job.ref.uid, [f"{kind}/{manifest['metadata']['name']}"])
        return CREATED

    def _count_refusals(self, uid: str, refused: dict[str, tuple[str, str]]) -> None:
        """One more refusal in a row for each kind refused in this pass (a pass's pods count once)."""
        now = self.clock()
        with self._refusals_lock:
            kinds = self._refusals.setdefault(uid, {})
            for kind, (name, message) in refused.items():
                last = kinds.get(kind)
                kinds[kind] = CreateRefusal(kind, name, (last.attempts if last else 0) + 1, now, message)

    def _write_status(self, job: ColocateJob, body: dict[str, Any], patch: dict[str, Any]) -> bool:
        resource_version = body["metadata"].get("resourceVersion")
        ns, name = job.ref.namespace, job.ref.name
        try:
            written = self.api.patch(
                kube.COLOCATE_JOBS,
                ns,
                name,
                {"metadata": {"resourceVersion": resource_version}, "status": patch},
                subresource="status",
            )
        except kube.KubeError as e:
            if e.status == 409:  # the view was older than the job: the retry must not take it again
                self.indexes.status_conflict(ns, name, resource_version)
            if e.status in (404, 409):
                return False
            raise
        self.indexes.wrote_status(ns, name, written)
        metrics.STATUS_WRITES.labels("reconciler").inc()
        patched = StatusView(patch)
        if patched.has("restarts"):
            metrics.RESTARTS.labels(job.ref.namespace, job.ref.name).set(patched.restarts)
        changed = sorted(patch)
        log.info(
            "status updated",
            extra={
                "job": f"{job.ref.namespace}/{job.ref.name}",
                "fields": changed,
                "phase": patched.phase,
            },
        )
        return True

    def _post_event(self, body: dict[str, Any], event: EventSpec) -> None:
        kube_events.post_event(self.api, body, event.type, event.reason, event.message)


@dataclass
class _Found:
    """What one pass's reads found of the job's children."""

    conflicts: frozenset[str]  # names a create found taken (409), read until resolved
    children: set[str] = field(default_factory=set)  # keys (Kind/name) of the children that are the job's
    foreign: list[ForeignChild] = field(default_factory=list)  # objects holding a child's name, not ours


def _announces(event: EventSpec, held: set[str]) -> bool:
    """The Event announces creating children of a kind this pass held back (it would be posted again by
    the pass that creates them: after an operator restart or a leader change, twice)."""
    return (event.reason == Reason.CREATED_PODS and "Pod" in held) or (
        event.reason == Reason.CREATED_META_STORE and "Deployment" in held
    )


def _wave(kind: str) -> int:
    return 0 if kind == "Secret" else 2 if kind == "Pod" else 1


def _outdated_secret(child: children.Child, meta: dict[str, Any]) -> bool:
    annotations = (meta.get("metadata") or {}).get("annotations") or {}
    return child.kind == "Secret" and annotations.get(SECRET_FORMAT_ANNOTATION) != SECRET_FORMAT


def _is_owned(body: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (body.get("metadata") or {}).get("ownerReferences") or [])
