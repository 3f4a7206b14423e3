"""The worker pods' own watch: list, then watch from the list's resourceVersion, feeding the pod index
(indexes.py) and queuing the job whose pods changed.

Not through kopf: kopf's handling of one watch event (its cause detection, handler selection, kwargs,
state and logging around every handler call) cost about 1.3 ms of CPU per pod event when profiled with
py-spy at 50 jobs, more than the index update itself; a job brings about 15 pod events until it is up.
This watch decodes the event's decision fields only (podevents.py) and updates the index, nothing else.

One thread per watched namespace, or one cluster-wide watch filtered by the namespace patterns when kopf is
given patterns (or none: cluster-wide). The API server filters by the worker pods' labels. A watch that ends
(its timeout, a dropped connection) goes on from the last resourceVersion seen; one that is too old (410
Gone) lists again, and a pod the new list lacks is gone. Until every watched namespace is listed once, the
index answers no pass (a pass then lists the job's pods itself).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from urllib3.exceptions import HTTPError

from colocate_operator import kube
from colocate_operator.constants import COMPONENT_WORKER, LABEL_COMPONENT, LABEL_JOB
from colocate_operator.indexes import Indexes
from colocate_operator.podevents import decode_event, decode_list

log = logging.getLogger("colocate_operator.podwatch")

WORKER_SELECTOR = f"{LABEL_JOB},{LABEL_COMPONENT}={COMPONENT_WORKER}"
MAX_BACKOFF_SECONDS = 30.0
LIST_PAGE = 500  # pods a list response
GLOB = set("*?!,")  # kopf's namespace patterns (see match_namespace below)


def match_namespace(name: str, pattern: str) -> bool:
    """kopf's own matching of a namespace pattern (globs, exclusions), so both watches agree."""
    from kopf._cogs.structs.references import match_namespace as kopf_match

    return bool(kopf_match(name, pattern))  # type: ignore[arg-type]


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class PodWatch:
    """`on_change(namespace, job)` is called (from the watch's thread) for every job whose pods changed in
    something a decision reads, once the index is ready."""

    def __init__(
        self,
        api: kube.Kube,
        indexes: Indexes,
        on_change: Callable[[str, str], None],
        namespaces: Sequence[str] = (),
        watch_seconds: int = kube.WATCH_SECONDS,
    ) -> None:
        self.api = api
        self.watch_seconds = watch_seconds  # each watch request's own end; the watch goes on from there
        self.indexes = indexes
        self.on_change = on_change
        patterns = list(namespaces)
        if not patterns or any(GLOB & set(p) for p in patterns):
            # One watch over all namespaces, keeping those the patterns select (all, without patterns).
            self._scopes: list[str | None] = [None]
            self._in_scope: Callable[[str], bool] = lambda ns: (
                not patterns or any(match_namespace(ns, p) for p in patterns)
            )
        else:
            self._scopes = sorted(set(patterns))
            self._in_scope = lambda ns: ns in self._scopes
        self._unlisted = set(self._scopes)
        self._lock = threading.Lock()
        self.events = 0  # watch events handled (tests read it)
        indexes.pods_listed = False

    def start(self, stop: threading.Event) -> list[threading.Thread]:
        threads = [
            threading.Thread(
                target=self._run, args=(scope, stop), name=f"podwatch-{scope or 'all'}", daemon=True
            )
            for scope in self._scopes
        ]
        for thread in threads:
            thread.start()
        return threads

    def _run(self, scope: str | None, stop: threading.Event) -> None:
        backoff = 1.0
        version = ""
        while not stop.is_set():
            try:
                if not version:
                    version = self._list(scope)
                    backoff = 1.0
                version = self._watch(scope, version, stop)
            except _Expired:
                version = ""
            except (kube.KubeError, HTTPError, OSError, ValueError) as e:
                if isinstance(e, kube.KubeError) and e.status == 410:
                    version = ""  # too old, refused at the start of the request rather than in the stream
                    continue
                log.warning(
                    "watch of worker pods (%s) failed, again in %.0f s: %s", scope or "all", backoff, e
                )
                stop.wait(backoff)
                backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)

    def _list(self, scope: str | None) -> str:
        # In pages, each pod reduced to its decision fields as it is parsed: at thousands of pods a whole
        # list is hundreds of megabytes as Python objects.
        items, version = self.api.list_at(
            kube.PODS, scope, WORKER_SELECTOR, page=LIST_PAGE, parse=decode_list
        )
        if version is None:
            raise ValueError("the pod list carries no resourceVersion")
        items = [p for p in items if self._in_scope((p.get("metadata") or {}).get("namespace", ""))]
        in_scope = self._in_scope if scope is None else (lambda ns: ns == scope)
        changed = self.indexes.relisted_pods(in_scope, items, version)
        with self._lock:
            self._unlisted.discard(scope)
            if not self._unlisted:
                self.indexes.pods_listed = True
        self._queue(changed)
        return version

    def _watch(self, scope: str | None, version: str, stop: threading.Event) -> str:
        """Until the watch ends; returns the last resourceVersion seen."""
        events = self.api.watch(
            kube.PODS,
            scope,
            version,
            label_selector=WORKER_SELECTOR,
            timeout_seconds=self.watch_seconds,
            decode=decode_event,
        )
        for event in events:
            kind, body = event.get("type"), event.get("object") or {}
            meta = body.get("metadata") or {}
            if kind == "ERROR":
                if body.get("code") == 410:
                    raise _Expired()
                raise kube.KubeError(
                    int(body.get("code") or 0), str(body.get("reason")), str(body.get("message"))
                )
            version = meta.get("resourceVersion") or version
            if kind == "BOOKMARK" or not self._in_scope(meta.get("namespace", "")):
                continue
            self.events += 1
            job = (meta.get("labels") or {}).get(LABEL_JOB, "")
            if kind == "DELETED":
                self.indexes.pod_gone(body)
                self._queue({(meta.get("namespace", ""), job)})
            elif self.indexes.saw_pod(body):
                self._queue({(meta.get("namespace", ""), job)})
            if stop.is_set():
                break
        return version

    def _queue(self, jobs: set[tuple[str, str]]) -> None:
        # Until kopf has let the job handler run, the job's own first event queues it.
        if self.indexes.ready:
            for namespace, job in jobs:
                if job:
                    self.on_change(namespace, job)
