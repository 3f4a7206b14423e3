"""The operator's side of a suspend at a step boundary: read the trainer's checkpoint records from the job's
meta-store and write the request (and, on resume, withdraw it). The records are contract/checkpoint.py's;
decide.py says when (CheckpointWrite), this module only does the I/O.

The meta-store is dialed only while a suspend waits for running pods or resumes after a request, one short
connection per pass: a suspend is rare, so no client is kept. The password is read from the job's Secret as
the step follower reads it, and goes to an address the operator may dial (the Managed Redis it owns, or an
External one on its allow-list), never elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

import redis
from redis.exceptions import RedisError

from colocate_operator import kube
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Phase
from colocate_operator.decide import CheckpointWrite
from colocate_operator.metastore import endpoint
from colocate_operator.observed import CheckpointState, Observed
from colocate_operator.spec import ColocateJob
from colocate_operator.status import StatusView
from colocate_operator.stepwatch import check_managed_store_owned, password_from_secret
from colocate_runtime.contract.checkpoint import (
    CheckpointKeys,
    CheckpointRecordError,
    CheckpointRequest,
    decode_ack,
    decode_request,
    redis_time,
)

log = logging.getLogger("colocate_operator.checkpoints")
TIMEOUT_SECONDS = 3.0
MAX_RANKS = 4096  # a hash any container can write: read at most this many entries


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


def observe(
    api: kube.Kube, job: ColocateJob, status: dict[str, Any], observed: Observed, config: OperatorConfig
) -> Observed:
    if not wanted(job, status, observed):
        return observed
    try:
        client = _connect(api, job, config)
    except (CheckpointUnavailable, LookupError) as e:
        log.warning("checkpoint records of %s/%s not readable: %s", job.ref.namespace, job.ref.name, e)
        return replace(observed, checkpoint=CheckpointState(readable=False))
    try:
        return replace(observed, checkpoint=read(client, CheckpointKeys(job.ref.namespace, job.ref.name)))
    except RedisError as e:
        log.warning(
            "checkpoint records of %s/%s not readable: %s", job.ref.namespace, job.ref.name, type(e).__name__
        )
        return replace(observed, checkpoint=CheckpointState(readable=False))
    finally:
        client.close()


def read(client: redis.Redis, keys: CheckpointKeys) -> CheckpointState:
    """One round trip: registered ranks, the request, the ACKs. Entries that do not decode are left out."""
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.ranks)
    pipe.hkeys(keys.ranks)
    pipe.get(keys.request)
    pipe.hgetall(keys.acks)
    count, rank_names, raw_request, raw_acks = pipe.execute()
    ranks = frozenset(_text(r) for r in list(rank_names)[:MAX_RANKS]) if count <= MAX_RANKS else frozenset()
    request_id = None
    if raw_request is not None:
        with contextlib.suppress(CheckpointRecordError):  # any container can write it: not trusted
            request_id = decode_request(raw_request).id
    acks: dict[str, tuple[str, int]] = {}
    for rank, raw in list(raw_acks.items())[:MAX_RANKS]:
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


def execute(api: kube.Kube, job: ColocateJob, what: CheckpointWrite | None, config: OperatorConfig) -> None:
    """Carry out the plan's meta-store write; raises CheckpointUnavailable (the pass is retried, and nothing
    after it in the plan, such as creating the resumed pods, happens first)."""
    if what is None:
        return
    where = f"{job.ref.namespace}/{job.ref.name}"
    try:
        client = _connect(api, job, config)
    except LookupError as e:
        raise CheckpointUnavailable(f"checkpoint request of {where}: {e}") from None
    try:
        write(client, CheckpointKeys(job.ref.namespace, job.ref.name), what)
    except RedisError as e:
        raise CheckpointUnavailable(f"checkpoint request of {where}: {type(e).__name__}") from None
    finally:
        client.close()
    if what.request_id is not None:
        log.info("checkpoint requested", extra={"job": where, "request": what.request_id})
    if what.withdraw:
        log.info("checkpoint request withdrawn", extra={"job": where, "resume_step": what.resume_step})


def _connect(api: kube.Kube, job: ColocateJob, config: OperatorConfig) -> redis.Redis:
    store = endpoint(job, config)
    if not store.allowed:
        raise CheckpointUnavailable(store.refusal())
    ns, name = job.ref.namespace, job.ref.name
    if store.mode == "Managed":  # never our password to a Service someone else holds
        check_managed_store_owned(api, ns, name, job.ref.uid)
    password = password_from_secret(api, ns, store.secret_name, store.secret_key)
    host, _, port = store.address.rpartition(":")
    return redis.Redis(
        host=host,
        port=int(port),
        password=password,
        socket_timeout=TIMEOUT_SECONDS,
        socket_connect_timeout=TIMEOUT_SECONDS,
    )


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
