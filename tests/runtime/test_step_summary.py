"""Summary mode of the step-event stream (runtime/colocated/step_summary.py) against a real redis-server: the
job's GPUs' finishes make one `completed` record, written by whichever finish completes the set."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.contract import events as ev

pytestmark = pytest.mark.timeout(60)
KEYS = KeySchema("ns1", "summary-job")
GPUS = 4


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[MetaStore]:
    address = MetaStoreAddress("127.0.0.1", redis_server.port, redis_server.password)
    store = MetaStore.connect(address, KEYS, key_ttl_s=30, summary_gpus=GPUS)
    store.client.delete(KEYS.events(), *(KEYS.finished(s) for s in range(1, 4)))
    yield store
    store.close()


def finished(rank: int, step: int, *, gen: int = 1, seconds: float = 0.01) -> ev.StepEvent:
    """GPU `rank`'s successful finish of `step`, at time 100 + rank."""
    source = ev.EventSource("trainer", replica=rank // 2, rank=rank, gpu=f"GPU-{rank}")
    event = source.event(
        gen, step, "finished", result="ok", seconds=seconds, nbytes=1000 + rank, handles=2,
        weight_version=str(step), phase_seconds={"publish": 0.001},
    )  # fmt: skip
    return replace(event, ts=100.0 + rank)


def stream(store: MetaStore) -> list[ev.StepEvent]:
    return [e for _, e in store.read_events()]


def test_the_last_gpus_finish_writes_the_steps_one_completed_record(store: MetaStore) -> None:
    for rank in range(GPUS - 1):
        store.emit(finished(rank, 1, seconds=0.01 * (rank + 1)))
        assert stream(store) == []  # nothing until the set is complete
    store.emit(finished(GPUS - 1, 1, seconds=0.02))
    [done] = stream(store)
    assert (done.role, done.phase, done.result, done.step, done.gpu) == ("trainer", "completed", "ok", 1, "")
    assert done.seconds == pytest.approx(0.03)  # the slowest GPU's
    assert done.bytes == sum(1000 + r for r in range(GPUS)) and done.handles == 2 * GPUS
    assert done.ts == pytest.approx(100.0 + GPUS - 1)  # the latest
    assert (done.weight_version, done.rank, done.phase_seconds) == ("1", GPUS - 1, {})
    assert store.client.exists(KEYS.finished(1)) == 0  # the set is gone with the record
    assert store.client.pttl(KEYS.finished(2)) == -2


def test_a_finish_of_an_older_incarnation_does_not_complete_the_step(store: MetaStore) -> None:
    store.emit(*(finished(rank, 2) for rank in range(GPUS - 1)))
    store.client.set(KEYS.gen("GPU-0"), 2)  # GPU-0's trainer restarted: its gen-1 finish is stale
    store.emit(finished(GPUS - 1, 2))
    assert stream(store) == []
    assert store.client.hlen(KEYS.finished(2)) == GPUS - 1  # the stale one was dropped
    store.emit(finished(0, 2, gen=2))
    assert [e.phase for e in stream(store)] == ["completed"]


def test_the_set_keeps_the_key_ttl(store: MetaStore) -> None:
    store.emit(finished(0, 3))
    assert 0 < store.client.pttl(KEYS.finished(3)) <= 30_000


def test_progress_comes_from_replica_0_rank_0_and_failures_from_everyone(store: MetaStore) -> None:
    events = []
    for rank in (0, 1):
        trainer = ev.EventSource("trainer", replica=0, rank=rank, gpu=f"GPU-{rank}")
        reader = ev.EventSource("reader", replica=0, rank=rank, gpu=f"GPU-{rank}")
        events += [
            trainer.event(1, 1, "published"),
            reader.event(1, 1, "copied"),
            reader.event(1, 1, "finished", result="ok"),
            trainer.event(1, 1, "failed", result="timeout", error="no ACK"),
        ]
    store.emit(*events)
    got = [(e.role, e.rank, e.phase) for e in stream(store)]
    assert got == [
        ("trainer", 0, "published"),
        ("reader", 0, "copied"),
        ("reader", 0, "finished"),
        ("trainer", 0, "failed"),
        ("trainer", 1, "failed"),
    ]


def test_detailed_mode_writes_every_gpus_finish(redis_server: RedisServer) -> None:
    address = MetaStoreAddress("127.0.0.1", redis_server.port, redis_server.password)
    keys = KeySchema("ns1", "detailed-job")
    store = MetaStore.connect(address, keys, key_ttl_s=30)
    try:
        store.emit(*(finished(rank, 1) for rank in range(GPUS)))
        assert [e.phase for e in stream(store)] == ["finished"] * GPUS
        assert store.client.exists(keys.finished(1)) == 0
    finally:
        store.close()
