"""Idle step followers cost (almost) nothing (issue 35): a job's writer sleeps until its next decision or its
reader's news, and a reader whose wait for new entries runs out reads nothing, yet moves every stream's
caught-up time on. Latency is kept: a new entry is read at once, the catch-up barrier's question makes the
reader read at once, and a pause change wakes the job's writer. The control plane and redis-server are
real; only the reader's wait is shortened (READ_BLOCK_MAX_SECONDS) so that it runs out several times."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer
from colocate_operator import kube, step_follow, stream_reads
from colocate_operator.config import OperatorConfig
from colocate_operator.step_follow import decision_wait
from colocate_operator.step_stream import SKIP_EVENT_INTERVAL, JobStream, Skips
from colocate_operator.step_writes import StatusWrites
from colocate_operator.steps import StepTracker
from colocate_operator.stepwatch import StepWatchers
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.operator.test_stepwatch_many import create_jobs

CONFIG = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})
JOBS = 4
IDLE_SECONDS = 3.5
BLOCK_SECONDS = 1.0


def test_a_pending_skip_event_is_a_decision_the_follower_wakes_for() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.last_progress_ts = 1000.0
    writes = StatusWrites(written_phase=tracker.current_phase)
    skips = Skips(count=3, last_event=995.0)  # reported 5 s ago: the next Event is due in 55 s
    assert decision_wait(tracker, writes, False, 3600, 1000.0, skips) == 995.0 + SKIP_EVENT_INTERVAL - 1000.0
    skips.reported_count = 3  # nothing left to report: only the stall is ahead (an hour)
    assert decision_wait(tracker, writes, False, 3600, 1000.0, skips) == step_follow.DECISION_MAX_WAIT_SECONDS


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def follows(watchers: StepWatchers) -> list[JobStream]:
    return [f for reader in watchers.readers._by_endpoint.values() for f in reader.jobs.values()]


async def until(probe: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_idle_followers_read_nothing_and_wake_only_for_news(
    cluster: Any, namespace: str, crd: Any, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_reads, "READ_BLOCK_MAX_SECONDS", BLOCK_SECONDS)
    names = create_jobs(cluster, namespace, redis_server, JOBS)
    client = redis_server.client()
    watchers = StepWatchers(kube.Kube.from_environment(), CONFIG)

    async def scenario() -> None:
        for name in names:
            watchers.ensure(namespace, name)
        await until(lambda: len(follows(watchers)) == JOBS, 30, "every follower on the reader")
        await until(lambda: all(f.progress.caught_up_at > 0 for f in follows(watchers)), 30, "a first read")
        await asyncio.sleep(0.3)  # the writers' first decisions are made
        wakes, reads, waits = (
            [f.wakes for f in follows(watchers)],
            calls(client, "evalsha"),
            calls(client, "xread"),
        )
        idle_from = time.time()
        await asyncio.sleep(IDLE_SECONDS)
        # Idle: no bounded read at all, one blocking XREAD per run-out wait, no writer woke...
        assert calls(client, "evalsha") == reads
        assert 2 <= calls(client, "xread") - waits <= IDLE_SECONDS / BLOCK_SECONDS + 1
        assert [f.wakes for f in follows(watchers)] == wakes
        # ... and yet every stream counts as read to its end up to a moment ago (the barrier's answer).
        assert all(f.progress.caught_up_at >= idle_from for f in follows(watchers))

        # A step written now is read at once, not when the wait runs out.
        first = next(f for f in follows(watchers) if f.name == names[0])
        event = StepEvent(
            role="trainer", gen=1, step=1, phase="finished", result="ok", gpu="GPU-0", ts=time.time()
        )
        xadd(client, stream_key(namespace, names[0]), event)
        await until(lambda: first.tracker.last_completed_step == 1, BLOCK_SECONDS / 2, "the new step read")

        # The catch-up barrier asks from a reconcile worker's thread: the reader reads now, not in 60 s.
        monkeypatch.setattr(stream_reads, "READ_BLOCK_MAX_SECONDS", 60.0)
        await asyncio.sleep(BLOCK_SECONDS + 0.5)  # the reader is in a 60-s wait now
        reads, asked = calls(client, "evalsha"), time.time()
        assert await asyncio.to_thread(watchers.stream_progress, namespace, names[0]) is first.progress
        await until(lambda: first.progress.caught_up_at >= asked, 5, "a read after the barrier asked")
        assert calls(client, "evalsha") > reads

        # A resume starts the progress deadline anew: the sleeping writer wakes for it.
        woke = first.wakes
        watchers.set_paused(namespace, names[0], True)
        await until(lambda: first.wakes > woke, 2, "the writer woken by a pause")
        await watchers.stop_all()

    try:
        asyncio.run(scenario())
    finally:
        watchers.readers.close()
