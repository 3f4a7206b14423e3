"""Step events -> status: follows every ColocateJob's step-event stream in its Redis meta-store and turns it
into status (weightSync, recentSteps, WeightSyncHealthy, Progressing, IPCReady), metrics and throttled Events.

Streams are read by one reader per meta-store endpoint (address and password): the jobs sharing an External
store share one connection, one bounded read (STREAM_READ_SCRIPT: an entry larger than any step event stays
in the store, and is counted, reported and moved past) and one wait for new entries that reads none of them
(`_Bell`) over all their streams; a Managed store serves one job.
Each job keeps a small task (`follow`) that resolves its store's credentials, joins the endpoint's reader,
and writes status when the reader brings a step boundary or a decision falls due (stall, heartbeat, retry).
Status writes are coalesced per job: a write waits WRITE_SETTLE_SECONDS for the rest of a burst and comes at
most every WRITE_MIN_INTERVAL_SECONDS, so a burst of steps costs one write; phase-only changes wait for a
heartbeat. On start a stream is replayed from its beginning, so a restarted operator rebuilds the same status.

Async all the way: redis.asyncio for the streams, the blocking Kubernetes client only through
a thread pool of the followers' own, with what a write carries snapshotted on the event loop first. At most
WRITES_IN_FLIGHT status writes run at once; a job waiting for a turn takes its snapshot when its turn comes,
so an API server that answers slowly makes each write carry more steps rather than queue stale writes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from urllib3.exceptions import HTTPError

from colocate_operator import conditions, kube, metrics, names, rollout_check
from colocate_operator.conditions import Condition
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import GROUP, PLURAL, VERSION, Phase
from colocate_operator.indexes import version
from colocate_operator.kube_events import event_subject, post_event
from colocate_operator.metastore import MetaStoreEndpoint, endpoint
from colocate_operator.observed import StreamProgress
from colocate_operator.secret_reads import SecretReads
from colocate_operator.spec import ColocateJob
from colocate_operator.status import (
    RolloutStatus,
    StatusView,
    StepRecordStatus,
    WeightSyncStatus,
    step_patch,
)
from colocate_operator.steps import StepRecord, StepTracker, step_conditions
from colocate_runtime.contract.events import (
    ENTRY_MAX_FIELDS,
    FIELD_MAX_BYTES,
    STREAM_MAXLEN,
    EventError,
    decode,
    stream_key,
)

log = logging.getLogger("colocate_operator.steps")

# The reader's wait for new entries (a blocking XREAD) lasts at most this long. One that runs out moves
# progress.caught_up_at on without a read (nothing came), and the wait starts again: an idle endpoint costs
# the operator one small request per this interval, whatever its number of jobs' streams (issue 35). The
# catch-up barrier does not wait for it: asking a job's progress has its reader read at once (catch_up).
# Stopping cancels the reader wherever it waits.
READ_BLOCK_MAX_SECONDS = 30.0
READ_COUNT = 100  # entries per stream and XREAD: bounds what a lagging job holds decoded at once
# Entries per XREAD over all streams: the per-stream count shrinks with many jobs. A reply's entries are
# all in memory at once (about 2 KB each as parsed), and the operator's peak memory follows the largest
# reply: at 250 jobs a step per second, a floor of 16 a stream made replies of 4000 entries and added some
# 25 MiB of resident memory in the step window.
READ_ENTRIES_MAX = 2000
# ... but never fewer than this per stream (then the reply's bound is 8 x jobs). Each XREAD also costs
# about 20 us per stream it names: at 1000 jobs a floor of 2 took 16 XREADs per step (32 entries a stream)
# and the status caught up 75 s after the last step instead of 35 s.
READ_COUNT_MIN = 8
# After a reply that drained every stream, the next XREAD waits this long, so that busy streams cost one
# wake-up per interval (a batch each), not one per entry; a stream that filled its count is read at once.
READ_BATCH_SECONDS = 0.1
JOIN_SETTLE_SECONDS = 0.05  # jobs joining a reader at once (an operator's start) share one new XREAD
# A job's follower sleeps until its next due decision (stall, coalesced write, heartbeat, retry, Event) or
# its reader's news: at most this long, a safety net only. At 10 s, 250 idle jobs woke the event loop 25
# times a second for nothing: a third of the idle operator's CPU (issue 35).
DECISION_MAX_WAIT_SECONDS = 300.0
DECISION_MIN_WAIT_SECONDS = 0.05
WRITE_SETTLE_SECONDS = 0.25  # after a step boundary, the rest of a burst joins the same write
WRITE_MIN_INTERVAL_SECONDS = 2.0  # status writes per job at most this often (a step per second: every 2nd)
HEARTBEAT_SECONDS = 15.0  # a phase-only change waits at most this long to reach status
SUCCESS_EVENT_INTERVAL = 60.0  # StepCompleted Events per job at most this often; failures always
MAX_BACKOFF = 30.0
WRITE_RETRY_SECONDS = 10.0
CONFLICT_RETRY_SECONDS = 1.0
WRITE_TRIES = 5
WRITES_IN_FLIGHT = 16  # status writes at once, over all jobs (also the followers' API threads)
SKIP_EVENT_INTERVAL = 60.0  # skipped entries reach the job as one Event per job at most this often
EVENT_MESSAGE_MAX_CHARS = 1024
TRIM_EVERY = 1000  # entries read between two XTRIMs of a stream
# The largest entry the decoder can accept (ENTRY_MAX_FIELDS keys and values of FIELD_MAX_BYTES each): a
# larger one is skipped in the meta-store, never sent to the operator (any container can XADD hundreds of MB).
ENTRY_MAX_BYTES = 2 * ENTRY_MAX_FIELDS * FIELD_MAX_BYTES
# What one read brings at most, over all its streams (a real entry is a few hundred bytes: 2000 of them are
# well under it); a stream left out for it is read again at once.
READ_BYTES_MAX = 4 * 1024 * 1024
POLL_SECONDS = 1.0  # where the store refuses CLIENT REPLY (an ACL), new entries are looked for this often

# The bounded read (EVALSHA): per stream, the entries after its last id (at most ARGV[1]); an entry over
# ARGV[2] bytes or ARGV[3] fields is left in the store and only its id and size come back; the kept ones stop
# at ARGV[4] bytes in all. Per stream: {last id looked at, kept entries (as XRANGE has them), skipped
# {id, bytes} pairs, 1 when more may follow at once}. Needs Redis >= 6.2 (exclusive XRANGE ids).
STREAM_READ_SCRIPT = """
local count, entry_max, fields_max = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local out = {}
for i, key in ipairs(KEYS) do
  local last, kept, skipped, more = ARGV[4 + i], {}, {}, 0
  if budget < entry_max then
    more = 1
  else
    local entries = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', count)
    for _, entry in ipairs(entries) do
      local fields, size = entry[2], 0
      for _, value in ipairs(fields) do size = size + #value end
      if size > entry_max or #fields > 2 * fields_max then
        skipped[#skipped + 1] = {entry[1], size}
      elseif size > budget then
        more = 1
        break
      else
        budget = budget - size
        kept[#kept + 1] = entry
      end
      last = entry[1]
    end
    if #entries >= count then more = 1 end
  end
  out[i] = {last, kept, skipped, more}
end
return out
"""


class JobGone(Exception):
    """The job was deleted while its follower ran."""


# Credentials ---------------------------------------------------------------------------------------------


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


def _credentials(
    api: kube.Kube,
    store: MetaStoreEndpoint,
    namespace: str,
    name: str,
    uid: str | None,
    secret_reads: SecretReads | None = None,
    fresh: bool = True,
) -> str:
    """The store's password. An External store's Secret as the reconciler (or another follower) read it
    moments ago unless `fresh` (a reconnect after a failure reads it again: the password may have rotated)."""
    if store.mode == "Managed":  # never our password to a Service someone else holds (M2)
        check_managed_store_owned(api, namespace, name, uid)
    elif secret_reads is not None:
        seen = None if fresh else secret_reads.recent(namespace, store.secret_name)
        if seen is None and not fresh:  # nothing remembered: share a read in flight
            seen = secret_reads.read_shared(api, namespace, store.secret_name)
        elif seen is None or store.secret_key not in seen.data:  # a missing key is never taken from memory
            seen = secret_reads.read(api, namespace, store.secret_name)
        if seen is None or store.secret_key not in seen.data:
            raise LookupError(f"Secret {namespace}/{store.secret_name} has no key {store.secret_key!r}")
        return base64.b64decode(seen.data[store.secret_key]).decode()
    return password_from_secret(api, namespace, store.secret_name, store.secret_key)


def username_of(
    api: kube.Kube, store: MetaStoreEndpoint, namespace: str, secret_reads: SecretReads | None = None
) -> str | None:
    """The Redis user of the operator's password: None (`default`) for its Managed store; for an External one
    the Secret's `username` key where present (a shared store's per-job ACL user, operator/README.md)."""
    if store.mode == "Managed" or store.username_key is None:
        return None
    seen = secret_reads.recent(namespace, store.secret_name) if secret_reads is not None else None
    data = (
        seen.data
        if seen is not None
        else (api.get(kube.SECRETS, namespace, store.secret_name) or {}).get("data")
    )
    raw = (data or {}).get(store.username_key)
    if not raw:
        return None
    return base64.b64decode(raw).decode().strip() or None


# Status writes -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSnapshot:
    """What one status write carries, taken on the event loop (the reader goes on changing the tracker
    while the write runs in a thread)."""

    weight_sync: WeightSyncStatus
    recent_steps: tuple[StepRecordStatus, ...]
    conditions: tuple[Condition, ...]
    phase: str
    stalled: bool
    boundaries: int  # the follow's boundary count when taken
    newest: StepRecord | None
    rollout: RolloutStatus | None = None  # status.rollout (rollout_check.py)

    @classmethod
    def of(cls, tracker: StepTracker, stalled: bool, deadline: float, boundaries: int) -> StepSnapshot:
        return cls(
            tracker.weight_sync_status(),
            tracker.recent_steps_status(),
            tuple(step_conditions(tracker, stalled, deadline)),
            tracker.current_phase,
            stalled,
            boundaries,
            tracker.recent[-1] if tracker.recent else None,
            tracker.rollout.status(),
        )


@dataclass(frozen=True)
class JobView:
    """The job as the last status write left it (or as last read): enough to write again without a GET."""

    uid: str | None
    resource_version: str
    generation: int
    conditions: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, body: dict[str, Any]) -> JobView:
        meta = body["metadata"]
        return cls(
            meta.get("uid"),
            meta["resourceVersion"],
            int(meta.get("generation") or 0),
            tuple((body.get("status") or {}).get("conditions") or ()),
        )


def write_status(
    api: kube.Kube,
    namespace: str,
    name: str,
    snapshot: StepSnapshot,
    view: JobView | None = None,
    uid: str | None = None,
) -> JobView | None:
    """Patch the step-owned part of status with optimistic concurrency (the reconciler writes the rest),
    starting from `view` when given (no GET: the reconciler rarely writes a running job's status; a 409
    reads again). Returns the view the write left, None when every try lost a conflict; raises JobGone when
    the job no longer exists, or when `uid` is given and the job of that name is a newer one (deleted and
    created again: it gets its own follower)."""
    for _ in range(WRITE_TRIES):
        if view is None:
            body = api.get(kube.COLOCATE_JOBS, namespace, name)
            if body is None:
                raise JobGone(f"{namespace}/{name}")
            view = JobView.of(body)
        if uid is not None and view.uid != uid:
            raise JobGone(f"{namespace}/{name}")
        merged = conditions.merge(
            list(view.conditions), list(snapshot.conditions), datetime.now(UTC), view.generation
        )
        patch = {
            "metadata": {"resourceVersion": view.resource_version},
            "status": step_patch(snapshot.weight_sync, snapshot.recent_steps, merged, snapshot.rollout),
        }
        try:
            written = api.patch(kube.COLOCATE_JOBS, namespace, name, patch, subresource="status")
        except kube.KubeError as e:
            if e.status == 409:
                view = None  # the reconciler wrote in between: read again
                continue
            if e.status == 404:
                raise JobGone(f"{namespace}/{name}") from None
            raise
        metrics.STATUS_WRITES.labels("steps").inc()
        if not isinstance(written, str) or not written:
            return JobView(view.uid, "", view.generation, ())  # no resourceVersion echoed: read next time
        return JobView(view.uid, written, view.generation, tuple(merged))
    return None


def newer_view(mine: JobView | None, watched: JobView | None) -> JobView | None:
    """The newer of the view our last write left and the one the job's watch brought last (by
    resourceVersion; an opaque or empty one never counts as newer). None: read before writing."""
    if watched is None or mine is None:
        return mine
    newer = (version(watched.resource_version) or 0) > (version(mine.resource_version) or 0)
    return watched if newer else mine


@dataclass
class _Writes:
    boundaries: int = 0  # step boundaries already in status (the follow counts those it saw)
    dirty_since: float = 0.0  # when the oldest boundary not yet in status was seen
    last_write: float = 0.0
    written_phase: str = ""
    written_stalled: bool = False
    last_success_event: float = 0.0
    last_posted: tuple[int, str] | None = None  # (step, result) of the last step Event
    retry_at: float = 0.0  # after a refused write, wait before the next try (and the next log line)
    view: JobView | None = None


def decision_wait(
    tracker: StepTracker,
    writes: _Writes,
    dirty: bool,
    deadline: float,
    now: float,
    skips: _Skips | None = None,
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
        dues.append(_write_due(writes))
    if tracker.current_phase != writes.written_phase:
        dues.append(max(writes.retry_at, writes.last_write + HEARTBEAT_SECONDS))
    if skips is not None and skips.pending(tracker.dropped):
        dues.append(skips.last_event + SKIP_EVENT_INTERVAL)  # a rate-limited Event about skipped entries
    return min(DECISION_MAX_WAIT_SECONDS, max(DECISION_MIN_WAIT_SECONDS, min(dues) - now))


def _write_due(writes: _Writes) -> float:
    return max(
        writes.retry_at,
        writes.dirty_since + WRITE_SETTLE_SECONDS,
        writes.last_write + WRITE_MIN_INTERVAL_SECONDS,
    )


# One job's follow ----------------------------------------------------------------------------------------


@dataclass
class _Skips:
    """Entries skipped and GPUs/steps dropped, reported as one Event at most every SKIP_EVENT_INTERVAL."""

    count: int = 0
    last: str = ""
    reported_count: int = 0
    reported_dropped: int = 0
    last_event: float = float("-inf")
    oversized: int = 0  # entries over ENTRY_MAX_BYTES, left unread in the store
    largest: int = 0  # bytes of the largest of them since the last Event
    reported_oversized: int = 0

    def pending(self, dropped: int) -> bool:
        """Something not yet reported: skipped entries, or (`dropped`, the tracker's) GPUs/steps let go of."""
        return (
            self.count != self.reported_count
            or self.oversized != self.reported_oversized
            or dropped != self.reported_dropped
        )


@dataclass
class _Trim:
    """XTRIM MAXLEN ~ STREAM_MAXLEN every TRIM_EVERY entries read: the writers cap the stream themselves,
    but a writer that does not must not grow Redis or the next replay. A store that refuses XTRIM (an
    External one with a restricted user) is followed untrimmed."""

    unread: int = 0
    refused: bool = False

    async def maybe(self, client: aioredis.Redis, key: str, job: str) -> None:
        if self.refused or self.unread < TRIM_EVERY:
            return
        self.unread = 0
        try:
            # LIMIT 0: an approximate trim otherwise removes at most 10000 entries per call.
            await client.xtrim(key, maxlen=STREAM_MAXLEN, approximate=True, limit=0)
        except ResponseError as e:
            self.refused = True
            log.warning("the meta-store of %s refuses XTRIM, not trimming: %s", job, e)


@dataclass(eq=False)
class _Follow:
    """One job's stream state, shared by its reader (which feeds it entries) and its own task (which writes
    status). Both run on the event loop, so no lock."""

    namespace: str
    name: str
    uid: str | None
    key: str
    tracker: StepTracker
    progress: StreamProgress
    last_id: str = "0-0"
    boundaries: int = 0  # step boundaries seen
    reads: int = 0  # XREADs that covered this stream
    wakes: int = 0  # times its writer woke (news or a decision due): tests count them
    skips: _Skips = field(default_factory=_Skips)
    trim: _Trim = field(default_factory=_Trim)
    news: asyncio.Event = field(default_factory=asyncio.Event)  # the reader brought entries, or left
    lost: asyncio.Future[None] | None = None  # done when the reader lets go of the job (with its error)
    # The job as its newest watch event showed it (StepWatchers keeps it): a write starts from it when it is
    # newer than what the last write left, instead of losing a 409 to the reconciler's writes and reading.
    latest_view: Callable[[], JobView | None] | None = None

    @property
    def job(self) -> str:
        return f"{self.namespace}/{self.name}"

    def consume(self, entries: list[Any]) -> bool:
        """Fold entries (`[entry_id, [key, value, ...]]` each, as a raw XREAD reply holds them) into the
        tracker; True when its writer has news (a step boundary, a new phase, something to report), so that
        entries changing nothing it writes wake no task. The stream is untrusted input: whatever one entry
        raises, it is skipped and counted, never fatal."""
        self.trim.unread += len(entries)
        tracker = self.tracker
        mark = (self.boundaries, tracker.current_phase, self.skips.count, tracker.dropped)
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                event = decode(fields)
                before = (tracker.last_completed_step, len(tracker.recent))
                if tracker.observe(event):
                    self.boundaries += 1
                    _record_metrics(self.namespace, self.name, tracker, before)
            except Exception as e:  # one entry never stops the follower, whatever it holds
                self.skips.count += 1
                self.skips.last = str(e) if isinstance(e, EventError) else type(e).__name__
        return mark != (self.boundaries, tracker.current_phase, self.skips.count, tracker.dropped)

    def skip_oversized(self, skipped: list[Any], last: bytes | str) -> bool:
        """Count entries the bounded read left in the store (`[entry_id, bytes]` each) and move past them
        and everything else looked at up to `last`, so that no replay reads them again. True: there were."""
        self.last_id = last.decode() if isinstance(last, bytes) else str(last)
        for _, size in skipped:
            self.skips.oversized += 1
            self.skips.largest = max(self.skips.largest, int(size))
        return bool(skipped)

    def let_go(self, error: BaseException | None) -> None:
        if self.lost is not None and not self.lost.done():
            if error is None:
                self.lost.set_result(None)
            else:
                self.lost.set_exception(error)
        self.news.set()


# Readers: one bounded read and one wait for new entries per meta-store endpoint ---------------------------


def read_count(streams: int) -> int:
    """Entries per stream of one XREAD over `streams` streams."""
    return max(READ_COUNT_MIN, min(READ_COUNT, READ_ENTRIES_MAX // max(1, streams)))


def stream_client(address: str, password: str, **options: Any) -> aioredis.Redis:
    """A client of the meta-store at `address` whose XREAD replies come as the server sent them:
    `[[stream, [[entry_id, [key, value, ...]], ...]], ...]`. Each entry's fields stay one flat list, which
    `decode` reads, instead of redis-py building a dict per entry first (8000 entries a second at 250
    jobs)."""
    host, _, port = address.rpartition(":")
    client = aioredis.Redis(
        host=host,
        port=int(port),
        password=password,
        socket_timeout=READ_BLOCK_MAX_SECONDS + 5,
        socket_connect_timeout=5,
        retry=Retry(NoBackoff(), 0),  # the follower lets go and comes back with its own back-off
        **options,
    )
    client.set_response_callback("XREAD", _raw_reply)
    return client


def _raw_reply(response: Any, **_: Any) -> list[Any]:
    """`[[stream, entries], ...]` from the server's reply: an array (RESP2) or a map (RESP3, redis-py 8's
    default)."""
    if isinstance(response, dict):
        return list(response.items())
    return response or []


class _Bell:
    """Waits until a stream has an entry after a given id without reading the entry: on a connection of its
    own, `CLIENT REPLY SKIP` drops the reply of the blocking XREAD behind it (the entries, of any size), and
    the PING after that answers when the XREAD returns (an entry came, or its block ran out). Where the store
    refuses CLIENT REPLY (an ACL without it), it waits POLL_SECONDS instead."""

    PROBE = b"colocate-bell"

    def __init__(self, address: str, password: str, username: str | None = None) -> None:
        host, _, port = address.rpartition(":")
        self._options: dict[str, Any] = {
            "host": host,
            "port": int(port),
            "username": username,
            "password": password,
            "socket_timeout": READ_BLOCK_MAX_SECONDS + 5,
            "socket_connect_timeout": 5,
            "retry": Retry(NoBackoff(), 0),
        }
        self._connection: Connection | None = None
        self.skips: bool | None = None  # the store honours CLIENT REPLY SKIP (None: not asked yet)

    async def wait(self, streams: dict[str, str], timeout: float) -> None:
        if self.skips is False:
            await asyncio.sleep(min(timeout, POLL_SECONDS))
            return
        connection = await self._connected()
        if not self.skips:
            await asyncio.sleep(min(timeout, POLL_SECONDS))
            return
        block = ["BLOCK", max(1, round(timeout * 1000)), "COUNT", 1, "STREAMS", *streams, *streams.values()]
        try:
            commands = [("CLIENT", "REPLY", "SKIP"), ("XREAD", *block), ("PING",)]
            await connection.send_packed_command(connection.pack_commands(commands))
            await connection.read_response()  # the PING's answer: the XREAD has returned
        except BaseException:  # cancelled (a job joined) or failed: the connection's state is unknown
            await self.close()
            raise

    async def _connected(self) -> Connection:
        if self._connection is not None:
            return self._connection
        connection = Connection(**self._options)
        await connection.connect()
        self._connection = connection
        if self.skips is None:
            try:
                probe = [("CLIENT", "REPLY", "SKIP"), ("PING",), ("ECHO", self.PROBE)]
                await connection.send_packed_command(connection.pack_commands(probe))
                first = await connection.read_response()
                self.skips = first in (self.PROBE, self.PROBE.decode())
            except ResponseError:  # refused: the PING's and the ECHO's answers follow
                self.skips = False
            if not self.skips:
                log.warning("the meta-store at %s refuses CLIENT REPLY: polling it", self._options["host"])
                await self.close()
        return connection

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect()


class _Reader:
    """Reads the streams of every job attached to one endpoint in one loop: a bounded read of all of them
    (STREAM_READ_SCRIPT: entries over ENTRY_MAX_BYTES never leave the store, a reply is at most
    READ_BYTES_MAX), then, when nothing more is there, one wait for a new entry (`_Bell`). A job joining
    interrupts the wait (joins arriving together share the next read). A connection failure lets go of every
    job: each resolves its credentials again and joins anew."""

    def __init__(
        self, address: str, password: str, on_close: Callable[[_Reader], None], username: str | None = None
    ) -> None:
        self.client = stream_client(address, password, username=username)
        self.script = self.client.register_script(STREAM_READ_SCRIPT)
        self.bell = _Bell(address, password, username)
        self.jobs: dict[str, _Follow] = {}
        self.xreads = 0
        self._turn = 0  # the stream read first rotates: a reply's byte bound favours none
        self._joined = asyncio.Event()  # a job joined, or a catch-up was asked: read now
        self._quiet = False  # the last wait ran out with nothing new: the next one needs no read first
        self.waits_run_out = 0
        self._on_close = on_close
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    def attach(self, follow: _Follow) -> asyncio.Future[None]:
        if self.closed:
            raise ConnectionError("the reader closed")
        held = self.jobs.get(follow.key)
        if held is not None and held is not follow:
            raise ValueError(f"the stream of {follow.job} is followed already")
        follow.lost = asyncio.get_running_loop().create_future()
        follow.lost.add_done_callback(_retrieved)  # a follower cancelled meanwhile never looks at it
        follow.trim.unread = TRIM_EVERY  # trim before a replay from the start
        self.jobs[follow.key] = follow
        self._joined.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"steps-reader:{id(self)}")
        return follow.lost

    def catch_up(self) -> None:
        """Read every stream now (the catch-up barrier asks), not when the wait runs out."""
        if not self.closed:
            self._joined.set()

    def detach(self, follow: _Follow) -> None:
        if self.jobs.get(follow.key) is follow:
            del self.jobs[follow.key]
        if not self.jobs and self._task is not None and not self._task.done():
            self.closed = True  # a job joining now gets a new reader, not this stopping one
            self._task.cancel()

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            while self.jobs:
                await self._read_once()
        except asyncio.CancelledError:
            pass
        except (RedisError, OSError) as e:
            error = e
        except Exception as e:  # a defect: every job retries rather than waits on a dead reader
            log.exception("step stream reader failed")
            error = e
        finally:
            self.closed = True
            self._on_close(self)
            for follow in list(self.jobs.values()):
                follow.let_go(error or ConnectionError("the reader stopped"))
            self.jobs.clear()
            await self.bell.close()
            await self.client.aclose()

    async def _read_once(self) -> None:
        quiet = self._quiet and not self._joined.is_set()
        self._joined.clear()
        self._quiet = False
        jobs = dict(self.jobs)
        if quiet:  # nothing came during the last wait, and no job joined since: wait again, read nothing
            await self._wait_for_entries(jobs)
            return
        for key, follow in jobs.items():
            await follow.trim.maybe(self.client, key, follow.job)
        count = read_count(len(jobs))
        keys = list(jobs)
        self._turn = (self._turn + 1) % max(1, len(keys))
        keys = keys[self._turn :] + keys[: self._turn]
        issued = time.time()
        try:
            reply = await self.script(
                keys=keys,
                args=[count, ENTRY_MAX_BYTES, ENTRY_MAX_FIELDS, READ_BYTES_MAX]
                + [jobs[key].last_id for key in keys],
            )
        except ResponseError:
            if await self._let_go_of_broken_streams(jobs):
                return
            raise
        self.xreads += 1
        more, brought = self._deliver(jobs, keys, reply, issued)
        if more:
            return  # read again at once
        if brought:
            await asyncio.sleep(READ_BATCH_SECONDS)  # busy streams: a batch per interval
            return
        await self._wait_for_entries(jobs)

    async def _wait_for_entries(self, jobs: dict[str, _Follow]) -> None:
        """Until a stream has an entry after what was read, a job joins, a catch-up is asked, or
        READ_BLOCK_MAX_SECONDS pass. A wait that ran out read nothing new: every stream is caught up to
        when it began, with no read (a blocking XREAD that an entry ends early cannot take that long: one
        that came in its last instant is after `issued`, and the next wait returns at once for it)."""
        streams = {key: follow.last_id for key, follow in jobs.items()}
        issued, began = time.time(), time.monotonic()
        waiting = asyncio.ensure_future(self.bell.wait(streams, READ_BLOCK_MAX_SECONDS))
        joined = asyncio.ensure_future(self._joined.wait())
        try:
            await asyncio.wait({waiting, joined}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            joined.cancel()
            if not waiting.done():
                waiting.cancel()  # a job joined: read again over the new set of streams
        if not waiting.done() or waiting.cancelled():
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await waiting
            await asyncio.sleep(JOIN_SETTLE_SECONDS)
            return
        waiting.result()  # raises what the wait failed with
        if self.bell.skips and time.monotonic() - began >= READ_BLOCK_MAX_SECONDS:
            self._ran_out(jobs, issued)

    def _ran_out(self, jobs: dict[str, _Follow], issued: float) -> None:
        self._quiet = True
        self.waits_run_out += 1
        for key, follow in jobs.items():
            if self.jobs.get(key) is follow:
                follow.progress.caught_up_at = issued

    def _deliver(
        self, jobs: dict[str, _Follow], keys: list[str], reply: list[Any], issued: float
    ) -> tuple[bool, bool]:
        """Hand each stream's entries to its job; (some stream may have more at once, entries came)."""
        more = brought = False
        for key, (last, kept, skipped, full) in zip(keys, reply, strict=True):
            follow = jobs[key]
            if self.jobs.get(key) is not follow:
                continue  # detached while the read ran
            news = follow.consume(kept)
            news = follow.skip_oversized(skipped, last) or news
            follow.reads += 1
            # The reconciler's catch-up barrier before a pod exit counts as failure.
            failed = follow.tracker.final_result == "Failed"
            follow.progress.final_failure = (follow.tracker.final_message or "no message") if failed else None
            follow.progress.final = follow.tracker.final_result is not None
            if not full:
                follow.progress.caught_up_at = issued  # everything added before `issued` has been read
            if news:
                follow.news.set()
            more = more or bool(full)
            brought = brought or bool(kept or skipped)
        return more, brought

    async def _let_go_of_broken_streams(self, jobs: dict[str, _Follow]) -> bool:
        """One job's key that is no stream (any container of the job can write its Redis) fails the XREAD
        of every job on the endpoint: let go of that job only (it retries with backoff)."""
        pipe = self.client.pipeline(transaction=False)
        for key in jobs:
            pipe.type(key)
        types = await pipe.execute()
        broken = [
            (key, kind.decode() if isinstance(kind, bytes) else str(kind))
            for key, kind in zip(jobs, types, strict=True)
            if kind not in (b"stream", b"none", "stream", "none")
        ]
        for key, kind in broken:
            follow = jobs[key]
            self.detach(follow)
            follow.let_go(ValueError(f"the step stream key of {follow.job} holds a {kind}, not a stream"))
        return bool(broken)


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class Readers:
    """The readers of one operator, by endpoint, and the thread pool its followers call the API server
    through. Jobs share a reader when their store's address and password are the same (the password enters
    the key only as a digest)."""

    def __init__(self) -> None:
        self._by_endpoint: dict[tuple[str, str], _Reader] = {}
        self._pool = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="steps-api")
        self._write_turns: asyncio.Semaphore | None = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (a blocking API call) in the followers' thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def write_turns(self) -> asyncio.Semaphore:
        """Taken around a status write: at most WRITES_IN_FLIGHT at once, in the order asked (FIFO)."""
        if self._write_turns is None:
            self._write_turns = asyncio.Semaphore(WRITES_IN_FLIGHT)
        return self._write_turns

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._by_endpoint)

    def reader(self, address: str, password: str, username: str | None = None) -> _Reader:
        key = (address, hashlib.sha256(f"{username or ''}\0{password}".encode()).hexdigest())
        reader = self._by_endpoint.get(key)
        if reader is None or reader.closed:
            reader = _Reader(address, password, lambda r: self._closed(key, r), username)
            self._by_endpoint[key] = reader
        return reader

    def xreads(self) -> int:
        return sum(r.xreads for r in self._by_endpoint.values())

    def catch_up(self) -> None:
        """Every reader reads its streams now, not when its wait runs out (on the event loop)."""
        for reader in list(self._by_endpoint.values()):
            reader.catch_up()

    def _closed(self, key: tuple[str, str], reader: _Reader) -> None:
        if self._by_endpoint.get(key) is reader:
            del self._by_endpoint[key]


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
    state = _Follow(namespace, name, uid, key, tracker, progress or StreamProgress(), latest_view=latest_view)
    if news is not None:
        state.news = news
    writes = _Writes(view=JobView.of(body))
    body = event_subject(body)  # the follower lives as long as the job: it keeps what its Events name
    backoff = 1.0
    reader: _Reader | None = None
    fresh = False  # the first connection may use a recent read of the Secret; a reconnect reads it again
    try:
        while True:
            reads = state.reads
            try:
                password = await readers.call(
                    _credentials, api, store, namespace, name, uid, secret_reads, fresh
                )
                fresh = True
                username = await readers.call(username_of, api, store, namespace, secret_reads)
                reader = readers.reader(store.address, password, username)
                lost = reader.attach(state)
                deadline = float(sync.progress_deadline_seconds)
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
    state: _Follow,
    writes: _Writes,
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
            for reason, message in _skips_due(state, now):
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


def _note_boundaries(state: _Follow, writes: _Writes, now: float) -> bool:
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


def _skips_due(state: _Follow, now: float) -> list[tuple[str, str]]:
    """The (reason, message) Events due now, marking them reported: `StepEntriesSkipped` for entries left
    unread for their size, `StepStreamUntrusted` for entries that are not step events and state dropped."""
    skips, dropped_total = state.skips, state.tracker.dropped
    skipped, dropped = skips.count - skips.reported_count, dropped_total - skips.reported_dropped
    oversized = skips.oversized - skips.reported_oversized
    if not (skipped or dropped or oversized) or now - skips.last_event < SKIP_EVENT_INTERVAL:
        return []
    due = []
    if oversized:
        due.append(
            (
                "StepEntriesSkipped",
                f"skipped {oversized} step-stream entries over {ENTRY_MAX_BYTES} bytes (the largest "
                f"{skips.largest} bytes) without reading them: a step event is at most {ENTRY_MAX_FIELDS} "
                f"fields of {FIELD_MAX_BYTES} bytes",
            )
        )
    parts = []
    if skipped:
        parts.append(f"skipped {skipped} step-stream entries that are not step events (last: {skips.last})")
    if dropped:
        parts.append(f"let go of {dropped} GPUs or unfinished steps beyond the follower's bounds")
    if parts:
        due.append(("StepStreamUntrusted", "; ".join(parts)))
    skips.reported_count, skips.reported_dropped, skips.last_event = skips.count, dropped_total, now
    skips.reported_oversized, skips.largest = skips.oversized, 0
    return [(reason, message[:EVENT_MESSAGE_MAX_CHARS]) for reason, message in due]


def _record_metrics(namespace: str, name: str, tracker: StepTracker, before: tuple[int | None, int]) -> None:
    if tracker.last_completed_step != before[0] and tracker.last_completed_step is not None:
        metrics.LAST_COMPLETED_STEP.labels(namespace, name).set(tracker.last_completed_step)
        metrics.SYNC_SECONDS.labels(namespace, name).observe(tracker.last_sync_seconds)
    elif tracker.last_failure is not None and len(tracker.recent) != before[1]:
        metrics.FAILED_STEPS.labels(namespace, name).inc()


async def _maybe_write(
    api: kube.Kube, readers: Readers, body: dict[str, Any], state: _Follow, writes: _Writes, deadline: float
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
    await readers.call(_post_step_events, api, body, snapshot.newest, writes, newly_stalled, now)
    await rollout_check.after_write(readers.call, api, body, state.tracker.rollout, snapshot.rollout)


def _write_wanted(state: _Follow, writes: _Writes, deadline: float, now: float) -> bool:
    tracker = state.tracker
    tracker.pause(state.progress.paused, now)  # suspended: no stall; resumed: the deadline counts anew
    if now < writes.retry_at:
        return False
    dirty = state.boundaries != writes.boundaries
    heartbeat_due = (
        tracker.current_phase != writes.written_phase and now - writes.last_write >= HEARTBEAT_SECONDS
    )
    stall_changed = tracker.stalled(now, deadline) != writes.written_stalled
    return (dirty and now >= _write_due(writes)) or heartbeat_due or stall_changed


def _post_step_events(
    api: kube.Kube,
    body: dict[str, Any],
    newest: StepRecord | None,
    writes: _Writes,
    newly_stalled: bool,
    now: float,
) -> None:
    """Events at step boundaries, throttled: one per failed step, successes at most once a minute."""
    if newly_stalled:
        post_event(
            api, body, "Warning", "StepStalled", "no weight-update step within progressDeadlineSeconds"
        )
    if newest is None:
        return
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
