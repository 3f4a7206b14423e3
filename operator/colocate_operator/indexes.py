"""Watch-fed indexes of jobs and their worker pods: an event-driven pass reads neither from the API server.

kopf's index handlers (handlers.py) feed every watch event of a job or a worker pod in here; kopf holds all
other handlers back until the first listing of both is indexed, so no pass runs on a half-filled index. What
is kept is what decisions read: a job's body without managedFields, a pod's `PodState` facts.

A pass never acts on a view older than its own last write: each create, delete and status write of the
reconciler records the resourceVersion the API server answered with, and an index entry older than that is
stale, so the pass reads fresh instead (and the fresh read goes into the index). resourceVersions are
compared as integers, as every etcd-backed API server issues them; one that is not an integer makes the view
stale. Events are applied only when newer than the entry (kopf handles each object in its own task, so a
late event of a deleted object may follow its successor's). kopf does not report objects deleted while a
watch was down, so a job's view is also read fresh once it is older than `max_age` (the resync interval):
a lost deletion lives at most that long, as a child in `known.py` does.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from colocate_operator.constants import LABEL_JOB
from colocate_operator.observed import PodState

JobKey = tuple[str, str]  # (namespace, name)


def version(value: Any) -> int | None:
    """A resourceVersion as an integer; None when absent or opaque (then nothing counts as new enough)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def controller_uid(meta: Mapping[str, Any]) -> str:
    return next((r.get("uid", "") for r in meta.get("ownerReferences") or [] if r.get("controller")), "")


def reduced_job(body: Mapping[str, Any]) -> dict[str, Any]:
    """The job as decisions and Events see it: managedFields (most of a job's metadata) left out."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    out = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": meta}
    for part in ("spec", "status"):
        if body.get(part) is not None:
            out[part] = body[part]
    return out


@dataclass(frozen=True)
class PodFacts:
    state: PodState  # `owned` says only whether it has a controller; `pods()` decides whose
    controller: str
    version: int


@dataclass
class _Job:
    body: dict[str, Any] | None = None
    version: int = -1
    verified: float = 0.0  # when the job and its pods were last read in full (watch listing or fresh read)
    pods: dict[str, PodFacts] = field(default_factory=dict)  # by uid
    # uid -> version of its DELETED event: a late event of a deleted pod must not bring it back (a few per
    # restart; dropped with the job)
    gone: dict[str, int] = field(default_factory=dict)
    wrote_job: int = -1  # our newest status write
    created: dict[str, int] = field(default_factory=dict)  # pod name -> version of our create
    deleted: dict[str, int] = field(default_factory=dict)  # pod uid -> version of our delete


class Indexes:
    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self._clock = clock
        self._jobs: dict[JobKey, _Job] = {}
        self._lock = threading.Lock()
        # Set once kopf runs the first event handler: kopf runs none before every index is filled.
        self.ready = False
        # False while the pod watch (podwatch.py) has not listed every watched namespace once.
        self.pods_listed = True

    # Fed by the watch (the event loop) ----------------------------------------------------------------

    def saw_job(self, body: Mapping[str, Any]) -> None:
        with self._lock:
            self._keep_newer(body)

    def job_gone(self, namespace: str, name: str, uid: str) -> None:
        with self._lock:
            job = self._jobs.get((namespace, name))
            if job is not None and job.body is not None and job.body["metadata"].get("uid") == uid:
                del self._jobs[(namespace, name)]

    def saw_pod(self, body: Mapping[str, Any]) -> bool:
        """True when it changed something a decision reads (new, or other `PodState` facts or owner)."""
        meta = body.get("metadata") or {}
        rv, job_name = version(meta.get("resourceVersion")), (meta.get("labels") or {}).get(LABEL_JOB)
        if rv is None or not job_name:
            return False
        controller = controller_uid(meta)
        facts = PodFacts(PodState.from_body(body, controller), controller, rv)  # type: ignore[arg-type]
        with self._lock:
            return self._put_pod(self._job((meta.get("namespace", ""), job_name)), meta.get("uid", ""), facts)

    def pod_gone(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        rv, job_name = version(meta.get("resourceVersion")), (meta.get("labels") or {}).get(LABEL_JOB)
        with self._lock:
            job = self._jobs.get((meta.get("namespace", ""), job_name or ""))
            if job is None:
                return
            uid = meta.get("uid", "")
            job.pods.pop(uid, None)
            if rv is not None:
                job.gone[uid] = rv
                if job.created.get(meta.get("name", ""), rv + 1) <= rv:
                    del job.created[meta["name"]]

    # Recorded by the reconciler after each of its writes -----------------------------------------------

    def wrote_status(self, namespace: str, name: str, resource_version: str | None) -> None:
        """Our status write answered with this version (None: unknown, so the next view is read fresh)."""
        with self._lock:
            job = self._job((namespace, name))
            job.wrote_job = max(job.wrote_job, _or_newest(resource_version))

    def status_conflict(self, namespace: str, name: str, seen: str | None) -> None:
        """Our status write lost to a newer version than `seen`: a view of `seen` or older is stale."""
        with self._lock:
            job = self._job((namespace, name))
            job.wrote_job = max(job.wrote_job, _or_newest(seen) + 1)

    def created_pod(self, namespace: str, job_name: str, pod: str, resource_version: str | None) -> None:
        with self._lock:
            self._job((namespace, job_name)).created[pod] = _or_newest(resource_version)

    def deleted_pod(self, namespace: str, job_name: str, uid: str, resource_version: str | None) -> None:
        with self._lock:
            self._job((namespace, job_name)).deleted[uid] = _or_newest(resource_version)

    # Read by passes ------------------------------------------------------------------------------------

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The job as the watch last showed it (a copy), or None when absent, stale, or due a fresh read."""
        with self._lock:
            job = self._jobs.get((namespace, name))
            if (
                not self.ready
                or job is None
                or job.body is None
                or job.version < job.wrote_job
                or self._clock() - job.verified >= self.max_age
            ):
                return None
            return copy.deepcopy(job.body)

    def pods(self, namespace: str, name: str, uid: str) -> tuple[PodState, ...] | None:
        """The job's worker pods (`owned` against `uid`), or None while a write of ours is not in view."""
        with self._lock:
            job = self._jobs.get((namespace, name))
            if (
                not (self.ready and self.pods_listed)
                or job is None
                or self._clock() - job.verified >= self.max_age
            ):
                return None
            names = {p.state.name: p.version for p in job.pods.values()}
            if any(names.get(pod, -1) < rv for pod, rv in job.created.items()):
                return None
            for pod_uid, rv in job.deleted.items():
                facts = job.pods.get(pod_uid)
                if facts is not None and facts.version < rv and job.gone.get(pod_uid, -1) < rv:
                    return None
            job.created.clear()  # all in view: later views are newer still
            job.deleted.clear()
            return tuple(
                sorted(
                    (replace(p.state, owned=p.controller == uid) for p in job.pods.values()),
                    key=lambda s: s.name,
                )
            )

    def read_job(self, body: Mapping[str, Any]) -> None:
        """A job the pass read from the API server: it holds every write of ours before it."""
        with self._lock:
            job = self._keep_newer(body)
            if job is not None:
                job.wrote_job = min(job.wrote_job, job.version)

    def read_pods(
        self, namespace: str, name: str, pods: Iterable[Mapping[str, Any]], list_version: str | None
    ) -> None:
        """A job's worker pods as the pass listed them (at `list_version`): they replace older entries,
        drop those the list no longer holds, and hold every write of ours before it."""
        list_rv = version(list_version)
        if list_rv is None:
            return
        with self._lock:
            self._listed(self._job((namespace, name)), pods, list_rv, our_writes_before=None)

    # Read by the resync (resync.py), beside passes that may be writing: nothing here may claim a write of
    # ours that the list could predate.

    def listed_job(self, body: Mapping[str, Any]) -> None:
        """A job from a namespace list: kept when newer; unlike `read_job` it does not vouch for our writes
        (a pass may have written after the list's point in time), so a view older than one stays stale."""
        with self._lock:
            self._keep_newer(body)

    def listed_pods(
        self, namespace: str, name: str, pods: Iterable[Mapping[str, Any]], list_version: str | None
    ) -> None:
        """A job's worker pods from a namespace list at `list_version`: as `read_pods`, except that a create
        or delete of ours newer than the list still waits for the watch to show it."""
        list_rv = version(list_version)
        if list_rv is None:
            return
        with self._lock:
            self._listed(self._job((namespace, name)), pods, list_rv, our_writes_before=list_rv)

    def relisted_pods(
        self, in_scope: Callable[[str], bool], pods: Iterable[Mapping[str, Any]], list_version: str | None
    ) -> set[JobKey]:
        """The watch listed every worker pod of the namespaces `in_scope` accepts again (at `list_version`):
        it holds the listed pods, and those it no longer holds are gone (their deletions may have happened
        while the watch was down). Returns the jobs whose pods changed."""
        list_rv = version(list_version)
        changed: set[JobKey] = set()
        listed: set[str] = set()
        for pod in pods:
            meta = pod.get("metadata") or {}
            listed.add(meta.get("uid", ""))
            if self.saw_pod(pod):
                changed.add((meta.get("namespace", ""), (meta.get("labels") or {}).get(LABEL_JOB, "")))
        if list_rv is None:
            return changed
        with self._lock:
            for key, job in self._jobs.items():
                if not in_scope(key[0]):
                    continue
                for pod_uid in [u for u, p in job.pods.items() if u not in listed and p.version <= list_rv]:
                    del job.pods[pod_uid]
                    job.gone[pod_uid] = list_rv
                    changed.add(key)
        return changed

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def job_bodies(self) -> list[dict[str, Any]]:
        """Every job the watch has shown (copies), however old: what a new leader starts its followers on."""
        with self._lock:
            return [copy.deepcopy(job.body) for job in self._jobs.values() if job.body is not None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    # Internals -----------------------------------------------------------------------------------------

    def _listed(
        self, job: _Job, pods: Iterable[Mapping[str, Any]], list_rv: int, *, our_writes_before: int | None
    ) -> None:
        """A full list of the job's pods at `list_rv` (the lock held): it replaces older entries and drops
        those it no longer holds. `our_writes_before` None: our creates and deletes are all in it (the pass's
        own list); else only those up to the list's version (a list made beside passes)."""
        listed: set[str] = set()
        for pod in pods:
            meta = pod.get("metadata") or {}
            rv = version(meta.get("resourceVersion"))
            listed.add(meta.get("uid", ""))
            if rv is not None:
                controller = controller_uid(meta)
                facts = PodFacts(PodState.from_body(dict(pod), controller), controller, rv)
                self._put_pod(job, meta.get("uid", ""), facts)
        for pod_uid in [u for u, p in job.pods.items() if u not in listed and p.version <= list_rv]:
            del job.pods[pod_uid]
        if our_writes_before is None:
            job.created.clear()
            job.deleted.clear()
        else:
            job.created = {pod: rv for pod, rv in job.created.items() if rv > our_writes_before}
            job.deleted = {uid: rv for uid, rv in job.deleted.items() if rv > our_writes_before}
        job.verified = self._clock()

    def _keep_newer(self, body: Mapping[str, Any]) -> _Job | None:
        """The job's entry, holding `body` when it is newer than what the entry held (the lock held).
        None: a body without a resourceVersion, which cannot be ordered."""
        meta = body.get("metadata") or {}
        rv = version(meta.get("resourceVersion"))
        if rv is None:
            return None
        job = self._job((meta.get("namespace", ""), meta.get("name", "")))
        if rv > job.version:
            job.body, job.version = reduced_job(body), rv
        return job

    def _job(self, key: JobKey) -> _Job:
        job = self._jobs.get(key)
        if job is None:
            # First sight through the watch is a full read: kopf lists before it watches.
            job = self._jobs[key] = _Job(verified=self._clock())
        return job

    @staticmethod
    def _put_pod(job: _Job, uid: str, facts: PodFacts) -> bool:
        old = job.pods.get(uid)
        if (old is None or facts.version > old.version) and job.gone.get(uid, -1) < facts.version:
            job.pods[uid] = facts
            return old is None or (old.state, old.controller) != (facts.state, facts.controller)
        return False


_NEWEST = 1 << 62  # an unknown version: no view is new enough until a fresh read


def _or_newest(resource_version: str | None) -> int:
    rv = version(resource_version)
    return _NEWEST if rv is None else rv
