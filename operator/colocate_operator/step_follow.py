"""One job's step follower: resolves its store's credentials, joins the endpoint's reader, and writes
status when the reader brings a step boundary or a decision falls due (stall, heartbeat, retry), until the
job is gone. A reader that lets go of the job (the store unreachable, the password rotated) is joined again
with back-off. On start the stream is replayed from its beginning, so a restarted operator rebuilds the
same status.

Async all the way: the blocking Kubernetes client only through the followers' own thread pool
(`Readers.call`), at most WRITES_IN_FLIGHT status writes at once; a job waiting for a turn takes its
snapshot when its turn comes, so an API server that answers slowly makes each write carry more steps rather
than queue stale writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from urllib3.exceptions import HTTPError

from colocate_operator import kube, rollout_check
from colocate_operator.config import OperatorConfig
from colocate_operator.kube_events import event_subject, post_event
from colocate_operator.metastore import MetaStoreEndpoint, endpoint
from colocate_operator.observed import StreamProgress
from colocate_operator.secret_reads import SecretReads
from colocate_operator.spec import ColocateJob
from colocate_operator.step_events import post_step_events, skips_due
from colocate_operator.step_stream import SKIP_EVENT_INTERVAL, JobStream, Skips
from colocate_operator.step_writes import (
    HEARTBEAT_SECONDS,
    JobGone,
    JobView,
    StatusWrites,
    StepSnapshot,
    newer_view,
    write_due,
    write_status,
)
from colocate_operator.steps import StepTracker
from colocate_operator.store_credentials import password_of, username_of
from colocate_operator.stream_reads import Readers, StreamReader
from colocate_runtime.contract.events import stream_key

log = logging.getLogger("colocate_operator.steps")

# A job's follower sleeps until its next due decision (stall, coalesced write, heartbeat, retry, Event) or
# its reader's news: at most this long, a safety net only. At 10 s, 250 idle jobs woke the event loop 25
# times a second for nothing: a third of the idle operator's CPU (issue 35).
DECISION_MAX_WAIT_SECONDS = 300.0
DECISION_MIN_WAIT_SECONDS = 0.05
MAX_BACKOFF = 30.0
WRITE_RETRY_SECONDS = 10.0
CONFLICT_RETRY_SECONDS = 1.0


async def follow(
    namespace: str,
    name: str,
    api: kube.Kube,
    config: OperatorConfig,
    *,
    on_tracker: Callable[[StepTracker], None] | None = None,
    progress: StreamProgress | None = None,
    readers: Readers | None = None,
    body: dict[str, Any] | None = None,
    secret_reads: SecretReads | None = None,
    latest_view: Callable[[], JobView | None] | None = None,
    news: asyncio.Event | None = None,
) -> None:
    """Follow one job's stream until cancelled (job deleted or operator exiting) or the job is gone.

    The stream is untrusted input (any container of the job writes it): an entry that does not decode, or
    whatever else one entry raises, is skipped and counted, and the count reaches the job as one rate-limited
    Event. The stream is trimmed to STREAM_MAXLEN when the job joins its reader and as it is read, so neither
    Redis nor a replay from the start grows with what a writer that ignores MAXLEN appends. `readers` are
    the operator's (a private set when None); `on_tracker` sees the tracker once it exists (tests measure
    its state). `body` is the job as its watch event brought it (read here when None); `secret_reads` the
    operator's recent Secret reads, which spare the first connection a read of an External store's Secret;
    `latest_view` the job as its newest watch event showed it (a write starts from it when newer); `news`
    the event that wakes its writer (the caller sets it when the job's pause changes)."""
    private = readers is None
    readers = Readers() if readers is None else readers  # an empty Readers is falsy (len)
    try:
        await _follow(
            namespace, name, api, config, readers, on_tracker, progress, body, secret_reads, latest_view, news
        )
    finally:
        if private:
            readers.close()


async def _follow(
    namespace: str,
    name: str,
    api: kube.Kube,
    config: OperatorConfig,
    readers: Readers,
    on_tracker: Callable[[StepTracker], None] | None,
    progress: StreamProgress | None,
    body: dict[str, Any] | None,
    secret_reads: SecretReads | None,
    latest_view: Callable[[], JobView | None] | None = None,
    news: asyncio.Event | None = None,
) -> None:
    if body is None:
        body = await readers.call(api.get, kube.COLOCATE_JOBS, namespace, name)
    if body is None:
        return
    uid = body["metadata"].get("uid")
    job = ColocateJob.from_body(body)
    store = endpoint(job, config)
    if not store.allowed:  # never send the job's password to an address the operator may not dial
        log.warning("not following the steps of %s/%s: %s", namespace, name, store.refusal())
        return
    sync, world_size = job.spec.weight_sync, job.spec.world_size
    del job
    tracker = StepTracker(expected_gpus=world_size, history_limit=sync.history_limit)
    tracker.rollout = rollout_check.fold_for(sync.rollout_consistency, body)
    tracker.last_progress_ts = time.time()  # the progress deadline counts from when we start watching
    if on_tracker is not None:
        on_tracker(tracker)
    key = stream_key(namespace, name)
    state = JobStream(
        namespace, name, uid, key, tracker, progress or StreamProgress(), latest_view=latest_view
    )
    if news is not None:
        state.news = news
    writes = StatusWrites(view=JobView.of(body))
    body = event_subject(body)  # the follower lives as long as the job: it keeps what its Events name
    deadline = float(sync.progress_deadline_seconds)
    await _keep_following(api, readers, store, body, state, writes, secret_reads, deadline)


async def _keep_following(
    api: kube.Kube,
    readers: Readers,
    store: MetaStoreEndpoint,
    body: dict[str, Any],
    state: JobStream,
    writes: StatusWrites,
    secret_reads: SecretReads | None,
    deadline: float,
) -> None:
    """Join the store's reader and write status until the job is gone; a reader that lets go of the job is
    joined again with back-off (the credentials read again: the password may have rotated)."""
    namespace, name, uid = state.namespace, state.name, state.uid
    backoff = 1.0
    reader: StreamReader | None = None
    fresh = False  # the first connection may use a recent read of the Secret; a reconnect reads it again
    try:
        while True:
            reads = state.reads
            try:
                password = await readers.call(
                    password_of, api, store, namespace, name, uid, secret_reads, fresh
                )
                fresh = True
                username = await readers.call(username_of, api, store, namespace, secret_reads)
                reader = readers.reader(store.address, password, username)
                lost = reader.attach(state)
                await _write_until_lost(api, readers, body, state, writes, lost, deadline)
                lost.result()  # raises what the reader failed with
                raise ConnectionError("the reader let go")
            except JobGone:
                return
            except (RedisError, OSError, LookupError, ValueError, kube.KubeError, HTTPError) as e:
                if reader is not None:
                    reader.detach(state)
                    reader = None
                if state.reads > reads:
                    backoff = 1.0  # it read before it failed: a new failure, not a persisting one
                log.warning(
                    "step stream of %s/%s unavailable, retrying in %.0f s: %s",
                    namespace,
                    name,
                    backoff,
                    type(e).__name__ if isinstance(e, RedisError | HTTPError) else e,
                )
                if await readers.call(_job_gone, api, namespace, name, uid):
                    log.info("step follower of %s/%s stops: the job is gone", namespace, name)
                    return  # deleted while no watch event could stop us (L8)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
    finally:
        if reader is not None:
            reader.detach(state)


async def _write_until_lost(
    api: kube.Kube,
    readers: Readers,
    body: dict[str, Any],
    state: JobStream,
    writes: StatusWrites,
    lost: asyncio.Future[None],
    deadline: float,
) -> None:
    """Write status as the reader brings news, until it lets go of the job. Raises JobGone."""
    tracker = state.tracker
    while not lost.done():
        now = time.time()
        tracker.pause(state.progress.paused, now)  # a pause or resume that came while a write ran
        dirty = _note_boundaries(state, writes, now)
        wait = decision_wait(tracker, writes, dirty, deadline, now, state.skips)
        state.news.clear()
        state.wakes += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await state.news.wait()
        if lost.done():
            return
        now = time.time()
        _note_boundaries(state, writes, now)
        try:
            for reason, message in skips_due(state, now):
                await readers.call(post_event, api, body, "Warning", reason, message)
            await _maybe_write(api, readers, body, state, writes, deadline)
        except JobGone:
            raise
        except Exception as e:  # refused (KubeError) or the apiserver unreachable: retry, never die
            writes.retry_at = time.time() + WRITE_RETRY_SECONDS
            log.warning(
                "writing step status of %s/%s failed, retrying in %.0f s: %s",
                state.namespace,
                state.name,
                WRITE_RETRY_SECONDS,
                e if isinstance(e, kube.KubeError) else type(e).__name__,
            )


def decision_wait(
    tracker: StepTracker,
    writes: StatusWrites,
    dirty: bool,
    deadline: float,
    now: float,
    skips: Skips | None = None,
) -> float:
    """How long a job's writer may wait for its reader's news: until the next status decision that needs
    no new entry (a stall to write, a coalesced write due, a heartbeat, a retry, an Event about skipped
    entries). Everything else that changes a decision wakes it (the reader's news, a pause)."""
    dues = [now + DECISION_MAX_WAIT_SECONDS]
    if (
        not writes.written_stalled
        and tracker.final_result is None
        and tracker.last_progress_ts is not None
        and tracker.paused_since is None
    ):
        dues.append(tracker.last_progress_ts + deadline)  # the stall that would then be written
    if dirty:
        dues.append(write_due(writes))
    if tracker.current_phase != writes.written_phase:
        dues.append(max(writes.retry_at, writes.last_write + HEARTBEAT_SECONDS))
    if skips is not None and skips.pending(tracker.dropped):
        dues.append(skips.last_event + SKIP_EVENT_INTERVAL)  # a rate-limited Event about skipped entries
    return min(DECISION_MAX_WAIT_SECONDS, max(DECISION_MIN_WAIT_SECONDS, min(dues) - now))


def _note_boundaries(state: JobStream, writes: StatusWrites, now: float) -> bool:
    """Whether step boundaries wait for a write; the first since the last write starts the burst."""
    dirty = state.boundaries != writes.boundaries
    if dirty and writes.dirty_since <= writes.last_write:
        writes.dirty_since = now
    return dirty


def _job_gone(api: kube.Kube, namespace: str, name: str, uid: str | None) -> bool:
    """The job was deleted (or deleted and created again: the new one gets its own follower)."""
    try:
        body = api.get(kube.COLOCATE_JOBS, namespace, name, metadata_only=True)
    except (kube.KubeError, HTTPError, OSError):
        return False  # cannot tell: keep following
    return body is None or body["metadata"].get("uid") != uid


async def _maybe_write(
    api: kube.Kube,
    readers: Readers,
    body: dict[str, Any],
    state: JobStream,
    writes: StatusWrites,
    deadline: float,
) -> None:
    if not _write_wanted(state, writes, deadline, time.time()):
        return
    async with readers.write_turns():
        now = time.time()  # the turn may have come later: what it writes is what is known now
        stalled = state.tracker.stalled(now, deadline)
        snapshot = StepSnapshot.of(state.tracker, stalled, deadline, state.boundaries)
        start = newer_view(writes.view, state.latest_view() if state.latest_view else None)
        view = await readers.call(write_status, api, state.namespace, state.name, snapshot, start, state.uid)
    if view is None:
        writes.view = None
        writes.retry_at = now + CONFLICT_RETRY_SECONDS  # lost every try to other writers: back off a little
        return
    writes.view = view if view.resource_version else None
    newly_stalled = stalled and not writes.written_stalled
    writes.boundaries, writes.last_write = snapshot.boundaries, now
    writes.written_phase, writes.written_stalled = snapshot.phase, stalled
    budget = readers.success_events
    await readers.call(post_step_events, api, body, snapshot.newest, writes, newly_stalled, now, budget)
    await rollout_check.after_write(readers.call, api, body, state.tracker.rollout, snapshot.rollout)


def _write_wanted(state: JobStream, writes: StatusWrites, deadline: float, now: float) -> bool:
    tracker = state.tracker
    tracker.pause(state.progress.paused, now)  # suspended: no stall; resumed: the deadline counts anew
    if now < writes.retry_at:
        return False
    dirty = state.boundaries != writes.boundaries
    heartbeat_due = (
        tracker.current_phase != writes.written_phase and now - writes.last_write >= HEARTBEAT_SECONDS
    )
    stall_changed = tracker.stalled(now, deadline) != writes.written_stalled
    return (dirty and now >= write_due(writes)) or heartbeat_due or stall_changed
