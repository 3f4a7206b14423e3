"""The operator's side of a suspend at a step boundary: read the trainer's checkpoint records from the job's
meta-store and write the request (and, on resume, withdraw it). The records are contract/checkpoint.py's;
decide.py says when (CheckpointWrite), this module only does the I/O.

The meta-store is dialed only while a suspend waits for running pods or resumes after a request, one short
connection per operation: a suspend is rare, so no client is kept. The password is read from the job's Secret
as the step follower reads it, and goes to an address the operator may dial (the Managed Redis it owns, or an
External one on its allow-list), never elsewhere.

A job's store is the job's own: any of its containers can pause it (`CLIENT PAUSE`), slow it down or fill its
records with hundreds of megabytes. So the I/O never runs on the shared reconcile workers (`CheckpointIO`: its
own threads, at most one operation in flight per job, a pass waits at most WAIT_SECONDS for it and the
operation's end queues the job again), every socket operation times out after TIMEOUT_SECONDS with no retry,
and a read is one Lua script that returns only records within the contract's bounds (a record over them is
never sent to the operator).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, replace
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from colocate_operator import kube
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Phase
from colocate_operator.decide import CheckpointWrite
from colocate_operator.metastore import endpoint
from colocate_operator.observed import CheckpointState, Observed
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView
from colocate_operator.store_credentials import check_managed_store_owned, password_from_secret, username_of
from colocate_runtime.contract.checkpoint import (
    MAX_ID_CHARS,
    MAX_RECORD_BYTES,
    CheckpointKeys,
    CheckpointRecordError,
    CheckpointRequest,
    decode_ack,
    decode_request,
    redis_time,
)

log = logging.getLogger("colocate_operator.checkpoints")
TIMEOUT_SECONDS = 1.0  # connecting, and each reply: a store that does not answer in this is unavailable
WAIT_SECONDS = 0.5  # the longest a reconcile pass waits for its job's checkpoint I/O
THREADS = 8  # checkpoint I/O threads, over all jobs (an operation takes at most a few TIMEOUT_SECONDS)
MAX_RANKS = 4096  # a hash any container can write: read at most this many entries
RANK_MAX_BYTES = MAX_ID_CHARS  # a rank's name ("0", "17", ...)

# One round trip, bounded: the registered ranks (none when there are over MAX_RANKS), the request and the
# ACKs, each field and record only when within its bound (the contract's MAX_RECORD_BYTES), so the reply is
# at most a few MiB whatever the hashes hold. STRLEN before GET, HLEN before HKEYS/HGETALL.
READ_SCRIPT = """
local most, name_max, record_max = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local count = redis.call('HLEN', KEYS[1])
local ranks = {}
if count <= most then
  for _, rank in ipairs(redis.call('HKEYS', KEYS[1])) do
    if #rank <= name_max then ranks[#ranks + 1] = rank end
  end
end
local request = {}
if redis.call('STRLEN', KEYS[2]) <= record_max then
  local value = redis.call('GET', KEYS[2])
  if value then request[1] = value end
end
local acks = {}
if redis.call('HLEN', KEYS[3]) <= most then
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    if #flat[i] <= name_max and #flat[i + 1] <= record_max then
      acks[#acks + 1] = flat[i]
      acks[#acks + 1] = flat[i + 1]
    end
  end
end
return {count, ranks, request, acks}
"""


def client_options() -> dict[str, Any]:
    """Socket bounds for a store the operator dials from a thread: TIMEOUT_SECONDS to connect and for each
    reply, and no retry (redis-py 6 and later retry by default, 8.x 10 times with backoff; 5 does not)."""
    return {
        "socket_timeout": TIMEOUT_SECONDS,
        "socket_connect_timeout": TIMEOUT_SECONDS,
        "retry": Retry(NoBackoff(), 0),
    }


class CheckpointUnavailable(RuntimeError):
    """The meta-store could not be reached or refused the write; the message names the job, never secrets."""


def wanted(job: ColocateJob, status: dict[str, Any], observed: Observed) -> bool:
    """Whether this pass reads the records: a suspend (the user's, or Kueue's eviction, which decide.py takes
    through the same path) waits, or is about to, on the job's pods (a trainer may have exited after its
    ACK: the ACK still counts)."""
    workload = getattr(observed, "workload", None)  # a Kueue-queued job's Workload (kueue.py)
    stopping = job.spec.suspend or (workload is not None and bool(getattr(workload, "evicted", False)))
    return (
        stopping
        and job.spec.run_policy.suspend_grace_period_seconds > 0
        and StatusView(status).phase not in (Phase.SUSPENDED, *Phase.TERMINAL)
        and any(pod.owned and not pod.deleting for pod in observed.pods)
    )


def read(client: redis.Redis, keys: CheckpointKeys) -> CheckpointState:
    """One round trip (READ_SCRIPT): registered ranks, the request, the ACKs. Entries that do not decode, or
    that are over the contract's bounds (never sent), are left out."""
    count, rank_names, raw_request, raw_acks = client.eval(
        READ_SCRIPT,
        3,
        keys.ranks,
        keys.request,
        keys.acks,
        MAX_RANKS,
        RANK_MAX_BYTES,
        MAX_RECORD_BYTES,
    )
    ranks = frozenset(_text(r) for r in rank_names) if int(count) <= MAX_RANKS else frozenset()
    request_id = None
    if raw_request:
        with contextlib.suppress(CheckpointRecordError):  # any container can write it: not trusted
            request_id = decode_request(raw_request[0]).id
    acks: dict[str, tuple[str, int]] = {}
    for rank, raw in zip(raw_acks[::2], raw_acks[1::2], strict=True):
        try:
            ack = decode_ack(raw)
        except CheckpointRecordError:
            continue
        acks[_text(rank)] = (ack.id, ack.step)
    return CheckpointState(readable=True, ranks=ranks, request_id=request_id, acks=acks)


def write(client: redis.Redis, keys: CheckpointKeys, what: CheckpointWrite) -> None:
    if what.request_id is not None:
        request = CheckpointRequest(what.request_id, what.reason, redis_time(client.time()))
        client.set(keys.request, request.to_json())
    if what.withdraw:
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.request, keys.acks)
        if what.resume_step is not None:  # the trainer wrote it with its ACK; back only if the store lost it
            pipe.set(keys.resume, str(what.resume_step), nx=True)
        pipe.execute()


def read_store(api: kube.Kube, job: ColocateJob, config: OperatorConfig) -> CheckpointState:
    """The job's records as its store holds them now; not readable when the store (or its Secret) is not
    there or does not answer within the timeouts. Never raises: it runs on CheckpointIO's threads."""
    where = f"{job.ref.namespace}/{job.ref.name}"
    try:
        client = _connect(api, job, config)
    except (CheckpointUnavailable, LookupError) as e:
        log.warning("checkpoint records of %s not readable: %s", where, e)
        return CheckpointState(readable=False)
    except Exception as e:  # the API server: the next pass asks again
        log.warning("checkpoint records of %s not readable: %s", where, type(e).__name__)
        return CheckpointState(readable=False)
    try:
        return read(client, CheckpointKeys(job.ref.namespace, job.ref.name))
    except (RedisError, ValueError, TypeError) as e:  # unreachable, paused, or a reply of the wrong shape
        log.warning("checkpoint records of %s not readable: %s", where, type(e).__name__)
        return CheckpointState(readable=False)
    finally:
        client.close()


def write_store(
    api: kube.Kube, job: ColocateJob, what: CheckpointWrite, config: OperatorConfig
) -> str | None:
    """Carry out the plan's meta-store write; returns what went wrong (None: written). Never raises: it runs
    on CheckpointIO's threads. The message names the job, never secrets."""
    where = f"{job.ref.namespace}/{job.ref.name}"
    try:
        client = _connect(api, job, config)
    except (CheckpointUnavailable, LookupError) as e:
        return f"checkpoint request of {where}: {e}"
    except Exception as e:
        return f"checkpoint request of {where}: {type(e).__name__}"
    try:
        write(client, CheckpointKeys(job.ref.namespace, job.ref.name), what)
    except RedisError as e:
        return f"checkpoint request of {where}: {type(e).__name__}"
    finally:
        client.close()
    if what.request_id is not None:
        log.info("checkpoint requested", extra={"job": where, "request": what.request_id})
    if what.withdraw:
        log.info("checkpoint request withdrawn", extra={"job": where, "resume_step": what.resume_step})
    return None


def _connect(api: kube.Kube, job: ColocateJob, config: OperatorConfig) -> redis.Redis:
    store = endpoint(job, config)
    if not store.allowed:
        raise CheckpointUnavailable(store.refusal())
    ns, name = job.ref.namespace, job.ref.name
    if store.mode == "Managed":  # never our password to a Service someone else holds
        check_managed_store_owned(api, ns, name, job.ref.uid)
    password = password_from_secret(api, ns, store.secret_name, store.secret_key)
    host, _, port = store.address.rpartition(":")
    username = username_of(api, store, ns)
    return redis.Redis(host=host, port=int(port), username=username, password=password, **client_options())


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# Off the reconcile workers ---------------------------------------------------------------------------------

JobKey = tuple[str, str, str]  # namespace, name, uid
READ = "read"


@dataclass
class _Slot:
    """One job's checkpoint I/O: the operation in flight (or finished and not yet taken by a pass), what it
    is (READ or the CheckpointWrite), and the last read's answer."""

    future: Future[Any] | None = None
    operation: object = None
    notify: bool = False  # a pass stopped waiting for it: its end queues the job
    last_read: CheckpointState | None = None
    write_error: str | None = None  # the last withdraw's failure, until a write succeeds (decide reports it)


class CheckpointIO:
    """Runs the reconciler's checkpoint reads and writes on threads of its own, at most one per job at a
    time: a store that does not answer delays only its own job's suspend or resume, never another job's
    pass. A pass waits at most `wait` seconds; when the operation takes longer, the pass goes on without its
    answer (a read: the last one, or `pending`; a write: the pass stops before the pods) and the operation's
    end queues the job (`on_done(namespace, name)`) for a pass that takes the answer."""

    def __init__(
        self,
        api: kube.Kube,
        config: OperatorConfig,
        on_done: Callable[[str, str], None],
        *,
        threads: int = THREADS,
        wait: float = WAIT_SECONDS,
    ) -> None:
        self.api = api
        self.config = config
        self.wait = wait
        self._on_done = on_done
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint")
        self._slots: dict[JobKey, _Slot] = {}
        self._lock = threading.Lock()

    def observe(self, job: ColocateJob, status: dict[str, Any], observed: Observed) -> Observed:
        """`observed` with the job's checkpoint records while a suspend waits for its pods."""
        key = _key(job)
        observed = replace(observed, checkpoint_write_error=self.write_error(job))
        if not wanted(job, status, observed):
            with self._lock:
                slot = self._slots.get(key)
                if slot is not None:
                    slot.last_read = None  # the next suspend starts from a fresh read
            return observed
        with self._lock:  # a store that did not answer last time is not waited for: the answer queues the job
            last = self._slots.get(key, _Slot()).last_read
        wait = 0.0 if last is not None and not last.readable else self.wait
        done, state = self._run(key, READ, lambda: read_store(self.api, job, self.config), wait)
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
            if done:
                slot.last_read = state
            else:
                state = slot.last_read or CheckpointState(readable=False, pending=True)
        return replace(observed, checkpoint=state)

    def execute(self, job: ColocateJob, what: CheckpointWrite | None) -> bool:
        """Carry out the plan's meta-store write. True: written (or nothing to write); False: still on its
        way (the pass stops here and is queued again when it ends). Raises CheckpointUnavailable when the
        store refused or did not answer (the pass is retried, and nothing after it in the plan, such as
        creating the resumed pods, happens first)."""
        if what is None:
            return True
        write = functools.partial(write_store, self.api, job, what, self.config)
        done, error = self._run(_key(job), what, write, self.wait)
        if not done:
            return False
        with self._lock:
            slot = self._slots.setdefault(_key(job), _Slot())
            slot.write_error = error if what.withdraw else None  # a resume reports only its withdraw's
        if error is not None:
            raise CheckpointUnavailable(error)
        return True

    def write_error(self, job: ColocateJob) -> str | None:
        """Why the job's last withdraw failed; None once a write succeeded (or none failed)."""
        with self._lock:
            slot = self._slots.get(_key(job))
            return None if slot is None else slot.write_error

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            for key in [k for k in self._slots if k[:2] == (namespace, name)]:
                del self._slots[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: JobKey, operation: object, fn: Callable[[], Any], wait: float) -> tuple[bool, Any]:
        """(True, its result) when `operation` ended since the job's last pass or ends within `wait`
        seconds; (False, None) while it, or another operation of the job, is on its way."""
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
            future = slot.future
            if future is not None and future.done():
                slot.future = None
                if slot.operation == operation:
                    return True, future.result()
                future = None  # another operation's answer, no longer asked for
            if future is not None:
                slot.notify = True
                return False, None  # in flight since an earlier pass: not waited for twice
            future = self._pool.submit(fn)
            slot.future, slot.operation, slot.notify = future, operation, False
        future.add_done_callback(lambda f: self._finished(key, f))
        wait_for([future], timeout=wait)
        with self._lock:
            if future.done():
                if slot.future is future:
                    slot.future = None
                return True, future.result()
            slot.notify = True
        return False, None

    def _finished(self, key: JobKey, future: Future[Any]) -> None:
        with self._lock:
            slot = self._slots.get(key)
            notify = slot is not None and slot.future is future and slot.notify
        if notify:
            self._on_done(key[0], key[1])


def _key(job: ColocateJob) -> JobKey:
    return (job.ref.namespace, job.ref.name, job.ref.uid or "")
