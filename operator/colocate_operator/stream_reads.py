"""Reading the step streams: one reader per meta-store endpoint (address, user and password) for every job
whose store it is, so that jobs sharing an External store share one connection, one bounded read and one
wait for new entries over all their streams; a Managed store serves one job.

The read is bounded in the store (STREAM_READ_SCRIPT): an entry larger than any step event never leaves
Redis (it is counted and moved past), and one reply brings at most READ_BYTES_MAX. The wait for new entries
reads none of them (`Bell`): a container that XADDs hundreds of MB costs the operator nothing to wait on.
`Readers` also holds the thread pool through which the followers call the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from colocate_operator.step_stream import ENTRY_MAX_BYTES, TRIM_EVERY, JobStream
from colocate_operator.step_writes import SuccessEventBudget
from colocate_runtime.contract.events import ENTRY_MAX_FIELDS

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
WRITES_IN_FLIGHT = 16  # status writes at once, over all jobs (also the followers' API threads)
# What one read brings at most, over all its streams (a real entry is a few hundred bytes: 2000 of them are
# well under it); a stream left out for it is read again at once.
READ_BYTES_MAX = 4 * 1024 * 1024
POLL_SECONDS = 1.0  # where the store refuses CLIENT REPLY (an ACL), new entries are looked for this often

# The bounded read (EVALSHA): per stream, the entries after its last id (at most ARGV[1]); an entry over
# ARGV[2] bytes or ARGV[3] fields is left in the store and only its id and size come back; the kept ones stop
# at ARGV[4] bytes in all. Per stream: {last id looked at, kept entries, skipped {id, bytes} pairs, 1 when
# more may follow at once}. A kept entry is {id, its keys and values joined by NUL} where none of them holds
# a NUL, else as XRANGE has it: the operator parses one string an entry, not 34 (events.decode_joined), and
# the script measures an entry by its joined length, not field by field. In one process, 1000 jobs' entries
# (issue 35): 24 us of operator CPU an entry instead of 48, 16 us of Redis's instead of 18 (looking for a NUL
# with gsub instead cost 20). Needs Redis >= 6.2 (exclusive XRANGE ids).
STREAM_READ_SCRIPT = """
local count, entry_max, fields_max = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local concat, find = table.concat, string.find
local out = {}
for i, key in ipairs(KEYS) do
  local last, kept, skipped, more = ARGV[4 + i], {}, {}, 0
  if budget < entry_max then
    more = 1
  else
    local entries = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', count)
    for _, entry in ipairs(entries) do
      local fields = entry[2]
      local joined = concat(fields, '\\0')
      local size = #joined - #fields + 1
      if size > entry_max or #fields > 2 * fields_max then
        skipped[#skipped + 1] = {entry[1], size}
      elseif size > budget then
        more = 1
        break
      else
        budget = budget - size
        kept[#kept + 1] = find(concat(fields), '\\0', 1, true) and entry or {entry[1], joined}
      end
      last = entry[1]
    end
    if #entries >= count then more = 1 end
  end
  out[i] = {last, kept, skipped, more}
end
return out
"""


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


class Bell:
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


class StreamReader:
    """Reads the streams of every job attached to one endpoint in one loop: a bounded read of all of them
    (STREAM_READ_SCRIPT: entries over ENTRY_MAX_BYTES never leave the store, a reply is at most
    READ_BYTES_MAX), then, when nothing more is there, one wait for a new entry (`Bell`). A job joining
    interrupts the wait (joins arriving together share the next read). A connection failure lets go of every
    job: each resolves its credentials again and joins anew."""

    def __init__(
        self,
        address: str,
        password: str,
        on_close: Callable[[StreamReader], None],
        username: str | None = None,
    ) -> None:
        self.client = stream_client(address, password, username=username)
        self.script = self.client.register_script(STREAM_READ_SCRIPT)
        self.bell = Bell(address, password, username)
        self.jobs: dict[str, JobStream] = {}
        self.xreads = 0
        self._turn = 0  # the stream read first rotates: a reply's byte bound favours none
        # The next read, sent before the last reply is handed out when a stream had more (a backlog): the
        # store serves it while the operator decodes, instead of the two in turn (issue 35: at 1000 jobs a
        # step a second, 12-16 us of Redis and about 30 us of the operator per entry).
        self._next: _Read | None = None
        self.reads_ahead = 0
        self._joined = asyncio.Event()  # a job joined, or a catch-up was asked: read now
        self._quiet = False  # the last wait ran out with nothing new: the next one needs no read first
        self.waits_run_out = 0
        self._on_close = on_close
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    def attach(self, follow: JobStream) -> asyncio.Future[None]:
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

    def detach(self, follow: JobStream) -> None:
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
            await self._drop_next()
            await self.bell.close()
            await self.client.aclose()

    async def _read_once(self) -> None:
        quiet = self._quiet and not self._joined.is_set() and self._next is None
        self._joined.clear()
        self._quiet = False
        if quiet:  # nothing came during the last wait, and no job joined since: wait again, read nothing
            await self._wait_for_entries(dict(self.jobs))
            return
        read, self._next = self._next, None
        if read is None:
            read = await self._send(dict(self.jobs), None)
        try:
            reply = await read.reply
        except ResponseError:
            if await self._let_go_of_broken_streams(read.jobs):
                return
            raise
        self.xreads += 1
        if any(full for _, _, _, full in reply) and self.jobs:
            # A backlog: the next read goes out now, from where this reply ends, and the store serves it
            # while this one is decoded. Jobs that joined meanwhile are in it; ones that left are not.
            lasts = {
                key: last
                for key, (last, _, _, _) in zip(read.keys, reply, strict=True)
                if self.jobs.get(key) is read.jobs[key]  # not a job that left and joined anew meanwhile
            }
            self._next = await self._send(dict(self.jobs), lasts)
            self.reads_ahead += 1
        more, brought = self._deliver(read.jobs, read.keys, reply, read.issued)
        if more or self._next is not None:
            return  # read again at once
        if brought:
            await asyncio.sleep(READ_BATCH_SECONDS)  # busy streams: a batch per interval
            return
        await self._wait_for_entries(dict(self.jobs))

    async def _send(self, jobs: dict[str, JobStream], lasts: dict[str, Any] | None) -> _Read:
        """Send the bounded read of `jobs`' streams (each from its last id, or from `lasts` where the reply
        not yet handed out ends) without waiting for its reply."""
        for key, follow in jobs.items():
            await follow.trim.maybe(self.client, key, follow.job)
        count = read_count(len(jobs))
        keys = list(jobs)
        self._turn = (self._turn + 1) % max(1, len(keys))
        keys = keys[self._turn :] + keys[: self._turn]
        lasts = lasts or {}
        ids = [_text(lasts[key]) if key in lasts else jobs[key].last_id for key in keys]
        issued = time.time()
        args = [count, ENTRY_MAX_BYTES, ENTRY_MAX_FIELDS, READ_BYTES_MAX, *ids]
        reply = asyncio.ensure_future(self.script(keys=keys, args=args))
        await asyncio.sleep(0)  # the task sends the read now, before the caller decodes the last reply
        return _Read(jobs, keys, issued, reply)

    async def _wait_for_entries(self, jobs: dict[str, JobStream]) -> None:
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

    async def _drop_next(self) -> None:
        read, self._next = self._next, None
        if read is not None and not read.reply.done():
            read.reply.cancel()
        if read is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # the reader is stopping anyway
                await read.reply

    def _ran_out(self, jobs: dict[str, JobStream], issued: float) -> None:
        self._quiet = True
        self.waits_run_out += 1
        for key, follow in jobs.items():
            if self.jobs.get(key) is follow:
                follow.progress.caught_up_at = issued

    def _deliver(
        self, jobs: dict[str, JobStream], keys: list[str], reply: list[Any], issued: float
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

    async def _let_go_of_broken_streams(self, jobs: dict[str, JobStream]) -> bool:
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


@dataclass
class _Read:
    """A bounded read sent: the jobs and stream keys it covers (in the reply's order), when it was sent
    (what was added before that and not left for lack of room is in the reply) and the reply to come."""

    jobs: dict[str, JobStream]
    keys: list[str]
    issued: float
    reply: asyncio.Future[Any]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class Readers:
    """The readers of one operator, by endpoint, and the thread pool its followers call the API server
    through. Jobs share a reader when their store's address and password are the same (the password enters
    the key only as a digest)."""

    def __init__(self) -> None:
        self._by_endpoint: dict[tuple[str, str], StreamReader] = {}
        self._pool = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="steps-api")
        self._write_turns: asyncio.Semaphore | None = None
        self.success_events = SuccessEventBudget()  # StepCompleted Events over all the followers

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

    def reader(self, address: str, password: str, username: str | None = None) -> StreamReader:
        key = (address, hashlib.sha256(f"{username or ''}\0{password}".encode()).hexdigest())
        reader = self._by_endpoint.get(key)
        if reader is None or reader.closed:
            reader = StreamReader(address, password, lambda r: self._closed(key, r), username)
            self._by_endpoint[key] = reader
        return reader

    def xreads(self) -> int:
        return sum(r.xreads for r in self._by_endpoint.values())

    def catch_up(self) -> None:
        """Every reader reads its streams now, not when its wait runs out (on the event loop)."""
        for reader in list(self._by_endpoint.values()):
            reader.catch_up()

    def _closed(self, key: tuple[str, str], reader: StreamReader) -> None:
        if self._by_endpoint.get(key) is reader:
            del self._by_endpoint[key]
