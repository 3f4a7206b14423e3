"""One follower per ColocateJob that follows the job's step-event stream in its Redis meta-store and turns it
into status (weightSync, recentSteps, WeightSyncHealthy, Progressing), metrics and throttled Events.

Async all the way: redis.asyncio for the stream, the blocking Kubernetes client only through
asyncio.to_thread. Status writes are coalesced: one per step boundary, plus a heartbeat when only the
current phase moved. On start the stream is replayed from its beginning, so a restarted operator rebuilds
the same status.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from urllib3.exceptions import HTTPError

from colocate_operator import conditions, kube, metrics, names
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import GROUP, PLURAL, VERSION
from colocate_operator.kube_events import post_event
from colocate_operator.metastore import endpoint
from colocate_operator.observed import StreamProgress
from colocate_operator.spec import ColocateJob
from colocate_operator.steps import StepTracker, step_conditions
from colocate_runtime.colocated.events import STREAM_MAXLEN, EventError, decode, stream_key

log = logging.getLogger("colocate_operator.steps")

# An XREAD blocks until new entries or the next moment a decision is due without them (progress deadline,
# heartbeat, write retry), and at most this long: every wake-up is a Redis round trip per job, which at
# hundreds of jobs costs the operator a share of a core. Stopping cancels the task wherever it waits.
READ_BLOCK_MAX_SECONDS = 10.0
READ_BLOCK_MIN_SECONDS = 0.05
READ_COUNT = 100  # entries per XREAD: bounds what a lagging follower holds decoded at once
HEARTBEAT_SECONDS = 15.0  # a phase-only change waits at most this long to reach status
SUCCESS_EVENT_INTERVAL = 60.0  # StepCompleted Events per job at most this often; failures always
MAX_BACKOFF = 30.0
WRITE_RETRY_SECONDS = 10.0
CONFLICT_RETRY_SECONDS = 1.0
SKIP_EVENT_INTERVAL = 60.0  # skipped entries reach the job as one Event per job at most this often
EVENT_MESSAGE_MAX_CHARS = 1024
TRIM_EVERY = 1000  # entries read between two XTRIMs


class JobGone(Exception):
    """The job was deleted while its follower ran."""


@dataclass
class _Writes:
    dirty: bool = False  # a step boundary not yet in status (a write can lose 5 conflicts in a row)
    last_write: float = 0.0
    written_phase: str = ""
    written_stalled: bool = False
    last_success_event: float = 0.0
    last_posted: tuple[int, str] | None = None  # (step, result) of the last step Event
    retry_at: float = 0.0  # after a refused write, wait before the next try (and the next log line)


def check_managed_store_owned(api: kube.Kube, namespace: str, job: str, uid: str | None) -> None:
    """The Managed Redis Service and Secret must be the job's own (LookupError otherwise): an object of
    that name held by someone else would receive the job's password, or hand it theirs."""
    for kind, child in ((kube.SERVICES, names.metastore(job)), (kube.SECRETS, names.metastore_secret(job))):
        meta = api.get(kind, namespace, child, metadata_only=True)
        owners = [ref.get("uid") for ref in ((meta or {}).get("metadata") or {}).get("ownerReferences") or []]
        if meta is not None and uid not in owners:
            raise LookupError(f"{kind.plural} {namespace}/{child} is not owned by the job: not dialing it")


def password_from_secret(api: kube.Kube, namespace: str, name: str, key: str) -> str:
    secret = api.get(kube.SECRETS, namespace, name)
    if secret is None or key not in (secret.get("data") or {}):
        raise LookupError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(secret["data"][key]).decode()


def write_status(
    api: kube.Kube,
    namespace: str,
    name: str,
    tracker: StepTracker,
    stalled: bool,
    deadline: float,
    uid: str | None = None,
) -> bool:
    """Patch the step-owned part of status with optimistic concurrency (the reconciler writes the rest).
    False when every try lost a conflict; raises JobGone when the job no longer exists, or when `uid` is
    given and the job of that name is a newer one (deleted and created again: it gets its own follower)."""
    for _ in range(5):
        body = api.get(kube.COLOCATE_JOBS, namespace, name)
        if body is None or (uid is not None and body["metadata"].get("uid") != uid):
            raise JobGone(f"{namespace}/{name}")
        current = (body.get("status") or {}).get("conditions") or []
        merged = conditions.merge(
            current,
            step_conditions(tracker, stalled, deadline),
            datetime.now(UTC),
            int(body["metadata"].get("generation") or 0),
        )
        patch = {
            "metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
            "status": {
                "weightSync": tracker.weight_sync_status(),
                "recentSteps": tracker.recent_steps_status(),
                "conditions": merged,
            },
        }
        try:
            api.patch(kube.COLOCATE_JOBS, namespace, name, patch, subresource="status")
        except kube.KubeError as e:
            if e.status == 409:
                continue  # the reconciler wrote in between: read again
            if e.status == 404:
                raise JobGone(f"{namespace}/{name}") from None
            raise
        metrics.STATUS_WRITES.labels("steps").inc()
        return True
    return False


async def follow(
    namespace: str,
    name: str,
    api: kube.Kube,
    config: OperatorConfig,
    *,
    on_tracker: Callable[[StepTracker], None] | None = None,
    progress: StreamProgress | None = None,
) -> None:
    """Follow one job's stream until cancelled (job deleted or operator exiting) or the job is gone.

    The stream is untrusted input (any container of the job writes it): an entry that does not decode, or
    whatever else one entry raises, is skipped and counted, and the count reaches the job as one rate-limited
    Event. The stream is trimmed to STREAM_MAXLEN when the follower connects and as it reads, so neither
    Redis nor a replay from the start grows with what a writer that ignores MAXLEN appends. `on_tracker`
    sees the tracker once it exists (tests measure its state)."""
    body = await asyncio.to_thread(api.get, kube.COLOCATE_JOBS, namespace, name)
    if body is None:
        return
    uid = body["metadata"].get("uid")
    job = ColocateJob.from_body(body)
    store = endpoint(job, config)
    if not store.allowed:  # never send the job's password to an address the operator may not dial
        log.warning("not following the steps of %s/%s: %s", namespace, name, store.refusal())
        return
    sync = job.spec.weight_sync
    tracker = StepTracker(expected_gpus=job.spec.world_size, history_limit=sync.history_limit)
    tracker.last_progress_ts = time.time()  # the progress deadline counts from when we start watching
    if on_tracker is not None:
        on_tracker(tracker)
    key = stream_key(namespace, name)
    writes = _Writes()
    skips = _Skips()
    trim = _Trim()
    backoff = 1.0
    client: aioredis.Redis | None = None
    last_id = "0-0"
    try:
        while True:
            try:
                if client is None:
                    if store.mode == "Managed":  # never our password to a Service someone else holds (M2)
                        await asyncio.to_thread(check_managed_store_owned, api, namespace, name, uid)
                    password = await asyncio.to_thread(
                        password_from_secret, api, namespace, store.secret_name, store.secret_key
                    )
                    host, _, port = store.address.rpartition(":")
                    client = aioredis.Redis(
                        host=host,
                        port=int(port),
                        password=password,
                        socket_timeout=READ_BLOCK_MAX_SECONDS + 5,
                        socket_connect_timeout=5,
                    )
                    trim.unread = TRIM_EVERY  # trim before a replay from the start
                await trim.maybe(client, key, namespace, name)
                block = block_seconds(tracker, writes, sync.progress_deadline_seconds, time.time())
                issued = time.time()
                reply = await client.xread({key: last_id}, count=READ_COUNT, block=round(block * 1000))
                backoff = 1.0
            except (RedisError, OSError, LookupError, ValueError, kube.KubeError, HTTPError) as e:
                log.warning(
                    "step stream of %s/%s unavailable, retrying in %.0f s: %s",
                    namespace,
                    name,
                    backoff,
                    type(e).__name__ if isinstance(e, RedisError | HTTPError) else e,
                )
                if client is not None:
                    await client.aclose()
                    client = None
                if await asyncio.to_thread(_job_gone, api, namespace, name, uid):
                    log.info("step follower of %s/%s stops: the job is gone", namespace, name)
                    return  # deleted while no watch event could stop us (L8)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            boundary = False
            for _stream, entries in reply or []:
                trim.unread += len(entries)
                for entry_id, fields in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    try:
                        event = decode(fields)
                        before = (tracker.last_completed_step, len(tracker.recent))
                        if tracker.observe(event):
                            boundary = True
                            _record_metrics(namespace, name, tracker, before)
                    except Exception as e:  # one entry never stops the follower, whatever it holds
                        skips.count += 1
                        skips.last = str(e) if isinstance(e, EventError) else type(e).__name__
            if progress is not None:  # the reconciler's catch-up barrier before a pod exit counts as failure
                progress.final = tracker.final_result is not None
                if sum(len(entries) for _stream, entries in reply or []) < READ_COUNT:
                    progress.caught_up_at = issued  # everything added before `issued` has been read
            try:
                await asyncio.to_thread(_report_skips, api, body, tracker, skips, time.time())
                await _maybe_write(api, body, tracker, writes, boundary, sync.progress_deadline_seconds)
            except JobGone:
                return
            except Exception as e:  # refused (KubeError) or the apiserver unreachable: retry, never die
                writes.retry_at = time.time() + WRITE_RETRY_SECONDS
                log.warning(
                    "writing step status of %s/%s failed, retrying in %.0f s: %s",
                    namespace,
                    name,
                    WRITE_RETRY_SECONDS,
                    e if isinstance(e, kube.KubeError) else type(e).__name__,
                )
    finally:
        if client is not None:
            await client.aclose()


def _job_gone(api: kube.Kube, namespace: str, name: str, uid: str | None) -> bool:
    """The job was deleted (or deleted and created again: the new one gets its own follower)."""
    try:
        body = api.get(kube.COLOCATE_JOBS, namespace, name, metadata_only=True)
    except (kube.KubeError, HTTPError, OSError):
        return False  # cannot tell: keep following
    return body is None or body["metadata"].get("uid") != uid


@dataclass
class _Skips:
    """Entries skipped and GPUs/steps dropped, reported as one Event at most every SKIP_EVENT_INTERVAL."""

    count: int = 0
    last: str = ""
    reported_count: int = 0
    reported_dropped: int = 0
    last_event: float = float("-inf")


def _report_skips(
    api: kube.Kube, body: dict[str, Any], tracker: StepTracker, skips: _Skips, now: float
) -> None:
    skipped, dropped = skips.count - skips.reported_count, tracker.dropped - skips.reported_dropped
    if not (skipped or dropped) or now - skips.last_event < SKIP_EVENT_INTERVAL:
        return
    parts = []
    if skipped:
        parts.append(f"skipped {skipped} step-stream entries that are not step events (last: {skips.last})")
    if dropped:
        parts.append(f"let go of {dropped} GPUs or unfinished steps beyond the follower's bounds")
    post_event(api, body, "Warning", "StepStreamUntrusted", "; ".join(parts)[:EVENT_MESSAGE_MAX_CHARS])
    skips.reported_count, skips.reported_dropped, skips.last_event = skips.count, tracker.dropped, now


@dataclass
class _Trim:
    """XTRIM MAXLEN ~ STREAM_MAXLEN every TRIM_EVERY entries read: the writers cap the stream themselves,
    but a writer that does not must not grow Redis or the next replay. A store that refuses XTRIM (an
    External one with a restricted user) is followed untrimmed."""

    unread: int = 0
    refused: bool = False

    async def maybe(self, client: aioredis.Redis, key: str, namespace: str, name: str) -> None:
        if self.refused or self.unread < TRIM_EVERY:
            return
        self.unread = 0
        try:
            # LIMIT 0: an approximate trim otherwise removes at most 10000 entries per call.
            await client.xtrim(key, maxlen=STREAM_MAXLEN, approximate=True, limit=0)
        except ResponseError as e:
            self.refused = True
            log.warning("the meta-store of %s/%s refuses XTRIM, not trimming: %s", namespace, name, e)


def block_seconds(tracker: StepTracker, writes: _Writes, deadline: float, now: float) -> float:
    """How long the next XREAD may block: until the next status decision that needs no new entry."""
    dues = [now + READ_BLOCK_MAX_SECONDS]
    if not writes.written_stalled and tracker.final_result is None and tracker.last_progress_ts is not None:
        dues.append(tracker.last_progress_ts + deadline)  # the stall that would then be written
    if writes.dirty:
        dues.append(writes.retry_at)
    if tracker.current_phase != writes.written_phase:
        dues.append(max(writes.retry_at, writes.last_write + HEARTBEAT_SECONDS))
    return min(READ_BLOCK_MAX_SECONDS, max(READ_BLOCK_MIN_SECONDS, min(dues) - now))


def _record_metrics(namespace: str, name: str, tracker: StepTracker, before: tuple[int | None, int]) -> None:
    if tracker.last_completed_step != before[0] and tracker.last_completed_step is not None:
        metrics.LAST_COMPLETED_STEP.labels(namespace, name).set(tracker.last_completed_step)
        metrics.SYNC_SECONDS.labels(namespace, name).observe(tracker.last_sync_seconds)
    elif tracker.last_failure is not None and len(tracker.recent) != before[1]:
        metrics.FAILED_STEPS.labels(namespace, name).inc()


async def _maybe_write(
    api: kube.Kube,
    body: dict[str, Any],
    tracker: StepTracker,
    writes: _Writes,
    boundary: bool,
    deadline: float,
) -> None:
    now = time.time()
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    stalled = tracker.stalled(now, deadline)
    heartbeat_due = (
        tracker.current_phase != writes.written_phase and now - writes.last_write >= HEARTBEAT_SECONDS
    )
    writes.dirty = writes.dirty or boundary
    if now < writes.retry_at:
        return
    if not (writes.dirty or heartbeat_due or stalled != writes.written_stalled):
        return
    uid = body["metadata"].get("uid")
    if not await asyncio.to_thread(write_status, api, namespace, name, tracker, stalled, deadline, uid):
        writes.retry_at = now + CONFLICT_RETRY_SECONDS  # lost every try to other writers: back off a little
        return
    writes.dirty = False
    newly_stalled = stalled and not writes.written_stalled
    writes.last_write, writes.written_phase, writes.written_stalled = now, tracker.current_phase, stalled
    await asyncio.to_thread(_post_step_events, api, body, tracker, writes, newly_stalled, now)


def _post_step_events(
    api: kube.Kube,
    body: dict[str, Any],
    tracker: StepTracker,
    writes: _Writes,
    newly_stalled: bool,
    now: float,
) -> None:
    """Events at step boundaries, throttled: one per failed step, successes at most once a minute."""
    if newly_stalled:
        post_event(
            api, body, "Warning", "StepStalled", "no weight-update step within progressDeadlineSeconds"
        )
    if not tracker.recent:
        return
    newest = tracker.recent[-1]
    posted = (newest.step, newest.result)
    if posted == writes.last_posted:
        return
    if newest.result == "Failed":
        message = f"step {newest.step}: {newest.message}"[:EVENT_MESSAGE_MAX_CHARS]
        post_event(api, body, "Warning", "StepFailed", message)
    elif now - writes.last_success_event >= SUCCESS_EVENT_INTERVAL:
        post_event(
            api,
            body,
            "Normal",
            "StepCompleted",
            f"step {newest.step} synced {newest.bytes} bytes in {newest.sync_seconds:.3f} s",
        )
        writes.last_success_event = now
    else:
        return
    writes.last_posted = posted


class StepWatchers:
    """One follower task per job on kopf's event loop, started and stopped from the job's watch events.

    Not a kopf daemon: kopf puts a finalizer on every object that has a daemon, so deleting a job would hang
    whenever the operator is down. A follower that dies is started again by the job's next watch event.
    """

    def __init__(self, api: kube.Kube, config: OperatorConfig) -> None:
        self.api = api
        self.config = config
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._progress: dict[tuple[str, str], StreamProgress] = {}

    def __len__(self) -> int:
        return len(self._running)

    def stream_progress(self, namespace: str, name: str) -> StreamProgress | None:
        """How far the job's follower has read (any thread may ask: the reconciler's workers do)."""
        return self._progress.get((namespace, name))

    def ensure(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._running:
            return
        self._running[key] = asyncio.get_running_loop().create_task(
            self._run(namespace, name), name=f"steps:{namespace}/{name}"
        )

    def stop(self, namespace: str, name: str) -> None:
        task = self._running.get((namespace, name))
        if task is not None:
            task.cancel()  # wherever it waits: XREAD, a backoff, a status write

    async def stop_all(self, timeout: float = 10.0) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def _run(self, namespace: str, name: str) -> None:
        try:
            progress = self._progress.setdefault((namespace, name), StreamProgress())
            await follow(namespace, name, self.api, self.config, progress=progress)
        except Exception:
            log.exception(
                "step follower of %s/%s crashed; its next watch event starts it again", namespace, name
            )
        finally:
            self._running.pop((namespace, name), None)
            self._progress.pop((namespace, name), None)
            metrics.forget_job(namespace, name)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Start a step follower for every job the operator sees, stop it when the job is deleted."""

    @kopf.on.event(GROUP, VERSION, PLURAL, id="steps", registry=registry)
    async def job_event(event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        if "step_watchers" not in memo:
            memo.step_watchers = StepWatchers(memo.reconciler.api, config)
            memo.reconciler.stream_progress = memo.step_watchers.stream_progress
        if event.get("type") == "DELETED":
            memo.step_watchers.stop(namespace, name)
        else:
            memo.step_watchers.ensure(namespace, name)

    @kopf.on.cleanup(id="stop-steps", registry=registry)
    async def stop_followers(memo: kopf.Memo, **_: Any) -> None:
        if "step_watchers" in memo:
            await memo.step_watchers.stop_all()
