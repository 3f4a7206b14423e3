"""The trainer's checkpoint callback at a step boundary against a real, password-protected redis-server, with
the operator's own reader and writer of the records (operator/colocate_operator/checkpoints.py) on the
other side: request -> callback -> ACK and resume step; stale requests, a failing callback, a lost store."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_operator import checkpoints
from colocate_operator.decide import CheckpointWrite
from colocate_runtime.colocated.checkpoint import CheckpointRequests
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore, MetaStoreUnavailable
from colocate_runtime.contract.checkpoint import CheckpointKeys, decode_step
from tests.runtime.colocated_env import open_store

pytestmark = pytest.mark.timeout(60)
KEYS = KeySchema("ns1", "job1")
RECORDS = CheckpointKeys("ns1", "job1")


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[MetaStore]:
    yield from open_store(redis_server, KEYS)


def trainer(store: MetaStore, rank: int = 0) -> tuple[CheckpointRequests, list[int]]:
    saved: list[int] = []
    requests = CheckpointRequests(store, saved.append, rank=rank)
    requests.register()
    return requests, saved


def test_a_request_runs_the_callback_once_at_the_next_boundary_and_is_acknowledged(
    store: MetaStore, redis_server: RedisServer
) -> None:
    ranks = [trainer(store, rank) for rank in (0, 1)]
    operator = redis_server.client()
    seen = checkpoints.read(operator, RECORDS)
    assert seen.readable and seen.ranks == {"0", "1"} and seen.request_id is None and seen.acks == {}

    # No request: a boundary is one GET and nothing else.
    assert not any(requests.at_step_boundary(3) for requests, _ in ranks)
    assert all(saved == [] for _, saved in ranks)

    checkpoints.write(operator, RECORDS, CheckpointWrite(request_id="2026-12-01T18:00:00Z", reason="test"))
    assert checkpoints.read(operator, RECORDS).request_id == "2026-12-01T18:00:00Z"
    for requests, saved in ranks:
        assert requests.at_step_boundary(4), "the request stops the step loop"
        assert saved == [4] and requests.checkpointed_step == 4
        assert not requests.at_step_boundary(5), "a request is answered once"
        assert saved == [4]
    seen = checkpoints.read(operator, RECORDS)
    assert seen.acks == {"0": ("2026-12-01T18:00:00Z", 4), "1": ("2026-12-01T18:00:00Z", 4)}
    assert decode_step(operator.get(RECORDS.resume)) == 4

    # A restarted trainer reads its resume step, and the request left in the store does not stop it.
    again, saved = trainer(store)
    assert again.resume_step() == 4
    assert not again.at_step_boundary(5) and saved == []


def test_resume_withdraws_the_request_and_puts_back_a_lost_resume_step(
    store: MetaStore, redis_server: RedisServer
) -> None:
    operator = redis_server.client()
    requests, _ = trainer(store)
    checkpoints.write(operator, RECORDS, CheckpointWrite(request_id="first", reason="test"))
    assert requests.at_step_boundary(7)
    operator.delete(RECORDS.resume)  # as if Redis restarted during the suspension (it keeps no data)
    checkpoints.write(operator, RECORDS, CheckpointWrite(withdraw=True, resume_step=7))
    assert operator.get(RECORDS.request) is None and operator.hlen(RECORDS.acks) == 0
    assert CheckpointRequests(store, print).resume_step() == 7
    # The trainer's own record wins over the operator's copy (NX).
    operator.set(RECORDS.resume, "9")
    checkpoints.write(operator, RECORDS, CheckpointWrite(withdraw=True, resume_step=7))
    assert CheckpointRequests(store, print).resume_step() == 9


def test_a_failing_callback_writes_no_ack(store: MetaStore, redis_server: RedisServer) -> None:
    operator = redis_server.client()

    def fail(step: int) -> None:
        raise OSError(f"disk full at step {step}")

    requests = CheckpointRequests(store, fail)
    requests.register()
    checkpoints.write(operator, RECORDS, CheckpointWrite(request_id="r", reason="test"))
    with pytest.raises(OSError, match="disk full at step 2"):
        requests.at_step_boundary(2)
    assert checkpoints.read(operator, RECORDS).acks == {}
    assert requests.resume_step() is None


def test_records_that_do_not_decode_are_ignored(store: MetaStore, redis_server: RedisServer) -> None:
    operator = redis_server.client()
    requests, saved = trainer(store)
    operator.set(RECORDS.request, b"\xff not json")
    operator.set(RECORDS.resume, "-3")
    operator.hset(RECORDS.acks, mapping={"0": "{}", "1": json.dumps({"id": "r", "step": 2**70})})
    assert not requests.at_step_boundary(1) and saved == []
    assert requests.resume_step() is None
    seen = checkpoints.read(operator, RECORDS)
    assert seen.request_id is None and seen.acks == {}


def test_an_unreachable_store_is_no_request_until_it_answers(
    store: MetaStore, redis_server: RedisServer
) -> None:
    requests, saved = trainer(store)
    redis_server.stop()
    assert not requests.at_step_boundary(1) and saved == []
    with pytest.raises(MetaStoreUnavailable):
        requests.resume_step()
