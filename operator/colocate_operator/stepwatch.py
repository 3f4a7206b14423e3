"""Step events -> status, wired into kopf: one step follower (step_follow.py) per ColocateJob the operator
sees, started and stopped from the job's watch events, turning the job's step-event stream in its Redis
meta-store into status (weightSync, recentSteps, WeightSyncHealthy, Progressing, IPCReady), metrics and
throttled Events.

The pieces: the store's credentials (store_credentials.py), one job's stream state (step_stream.py), the
readers shared per meta-store endpoint (stream_reads.py), the coalesced status writes (step_writes.py), the
Events (step_events.py) and the follow loop itself (step_follow.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from colocate_operator import kube, metrics
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import GROUP, PLURAL, VERSION, Phase
from colocate_operator.observed import StreamProgress
from colocate_operator.secret_reads import SecretReads
from colocate_operator.status import StatusView
from colocate_operator.step_follow import follow
from colocate_operator.step_writes import JobView
from colocate_operator.stream_reads import Readers

log = logging.getLogger("colocate_operator.steps")


class StepWatchers:
    """One follow task per job on kopf's event loop, started and stopped from the job's watch events, and
    the readers they share.

    Not a kopf daemon: kopf puts a finalizer on every object that has a daemon, so deleting a job would hang
    whenever the operator is down. A follower that dies is started again by the job's next watch event.
    """

    def __init__(self, api: kube.Kube, config: OperatorConfig) -> None:
        self.api = api
        self.config = config
        self.readers = Readers()
        self.secret_reads = SecretReads(max_age=config.reconcile_interval_seconds)
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._progress: dict[tuple[str, str], StreamProgress] = {}
        self._views: dict[
            tuple[str, str], JobView
        ] = {}  # each followed job as its newest watch event showed it
        self._news: dict[tuple[str, str], asyncio.Event] = {}  # wakes a follower's writer
        self._loop: asyncio.AbstractEventLoop | None = None  # the followers' (kopf's), once one started

    def __len__(self) -> int:
        return len(self._running)

    def set_paused(self, namespace: str, name: str, paused: bool) -> None:
        """The job is Suspending or Suspended (or no longer): its follower counts no stall meanwhile. A change
        wakes the follower (it sleeps until its next decision: a resume starts its progress deadline)."""
        progress = self._progress.setdefault((namespace, name), StreamProgress())
        if progress.paused != paused:
            progress.paused = paused
            news = self._news.get((namespace, name))
            if news is not None:
                news.set()

    def stream_progress(self, namespace: str, name: str) -> StreamProgress | None:
        """How far the job's follower has read (any thread may ask: the reconciler's workers do). Asking is
        the catch-up barrier's (a pod exited without the final record in status): the readers read at once
        rather than when their wait for new entries runs out, so the next pass has its answer."""
        progress = self._progress.get((namespace, name))
        if progress is not None and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is closing: nothing to read for
                self._loop.call_soon_threadsafe(self.readers.catch_up)
        return progress

    def ensure(self, namespace: str, name: str, body: Mapping[str, Any] | None = None) -> None:
        """Start the job's follower unless it runs; `body` is the job as its watch event brought it."""
        key = (namespace, name)
        if body is not None and (body.get("metadata") or {}).get("resourceVersion"):
            self._views[key] = JobView.of(body)  # type: ignore[arg-type]
        if key in self._running:
            return
        self._loop = asyncio.get_running_loop()
        job = None if body is None else copy.deepcopy(dict(body))  # kopf keeps (and may change) its own
        self._running[key] = asyncio.get_running_loop().create_task(
            self._run(namespace, name, job), name=f"steps:{namespace}/{name}"
        )

    def stop(self, namespace: str, name: str) -> None:
        task = self._running.get((namespace, name))
        if task is not None:
            task.cancel()  # wherever it waits: credentials, a backoff, a status write

    async def stop_all(self, timeout: float = 10.0) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self.readers.close()

    async def _run(self, namespace: str, name: str, body: dict[str, Any] | None) -> None:
        try:
            progress = self._progress.setdefault((namespace, name), StreamProgress())
            news = self._news.setdefault((namespace, name), asyncio.Event())
            await follow(
                namespace,
                name,
                self.api,
                self.config,
                progress=progress,
                readers=self.readers,
                body=body,
                secret_reads=self.secret_reads,
                latest_view=lambda: self._views.get((namespace, name)),
                news=news,
            )
        except Exception:
            log.exception(
                "step follower of %s/%s crashed; its next watch event starts it again", namespace, name
            )
        finally:
            self._running.pop((namespace, name), None)
            self._progress.pop((namespace, name), None)
            self._views.pop((namespace, name), None)
            self._news.pop((namespace, name), None)
            metrics.forget_job(namespace, name)


def job_seen(
    memo: kopf.Memo, event_type: str | None, body: Mapping[str, Any], namespace: str, name: str
) -> None:
    """A job's watch event: start its follower (or stop it on DELETED). Called from the operator's one
    handler of job events (handlers.py), so that each job event costs kopf one handler call, not two."""
    if "step_watchers" not in memo:
        return
    if "reconciler" in memo and memo.reconciler.stream_progress is None:
        memo.reconciler.stream_progress = memo.step_watchers.stream_progress
        memo.reconciler.secret_reads = memo.step_watchers.secret_reads
    if event_type == "DELETED":
        memo.step_watchers.stop(namespace, name)
    else:
        memo.step_watchers.ensure(namespace, name, body)  # its body spares the follower a GET of the job
        paused = StatusView.of(body).phase in (Phase.SUSPENDING, Phase.SUSPENDED)
        memo.step_watchers.set_paused(namespace, name, paused)


def register(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    api: kube.Kube | None = None,
    *,
    watch_jobs: bool = True,
) -> None:
    """Start a step follower for every job the operator sees, stop it when the job is deleted. `api` is the
    followers' client (the environment's credentials at startup when None). `watch_jobs=False`: the caller's
    own handler of job events calls `job_seen` (handlers.py does)."""

    @kopf.on.startup(id="start-steps", registry=registry)
    def start_followers(memo: kopf.Memo, **_: Any) -> None:
        memo.step_watchers = StepWatchers(api or kube.Kube.from_environment(), config)
        if "reconciler" in memo:  # the reconciler's catch-up barrier asks how far a follower has read
            memo.reconciler.stream_progress = memo.step_watchers.stream_progress
            memo.reconciler.secret_reads = memo.step_watchers.secret_reads  # one Secret read per job

    if watch_jobs:

        @kopf.on.event(GROUP, VERSION, PLURAL, id="steps", registry=registry)
        async def job_event(
            event: dict[str, Any], body: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any
        ) -> None:
            job_seen(memo, event.get("type"), body, namespace, name)

    @kopf.on.cleanup(id="stop-steps", registry=registry)
    async def stop_followers(memo: kopf.Memo, **_: Any) -> None:
        if "step_watchers" in memo:
            await memo.step_watchers.stop_all()
