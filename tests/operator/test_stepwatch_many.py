"""Many jobs on one External meta-store, on the real control plane and a real redis-server: one reader (one
connection for its bounded reads over all the streams, one for its wait) follows every job's stream, a burst
of steps costs each job one status write, and one job whose stream key someone broke does not hold up the
others."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer
from colocate_operator import kube, metrics
from colocate_operator.config import OperatorConfig
from colocate_operator.step_follow import follow
from colocate_operator.steps import StepTracker
from colocate_operator.stream_reads import Readers
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, get_json, metastore_secret
from tests.operator.factories import body

pytestmark = pytest.mark.integration

CONFIG = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})
JOBS = 12
BURST = 10


def create_jobs(
    cluster: Any, namespace: str, server: RedisServer, count: int, *, secret: bool = True
) -> list[str]:
    if secret:
        metastore_secret(cluster, namespace, server)
    names = [f"steps-{i}" for i in range(count)]
    items = []
    for name in names:
        manifest = body(
            name,
            namespace,
            numNodes=1,
            gpusPerNode=1,
            metaStore=external_metastore(server),
            weightSync={"historyLimit": 3},
        )
        manifest["metadata"] = {"name": name, "namespace": namespace}
        items.append(manifest)
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    return names


def emit_steps(client: redis.Redis, namespace: str, names: list[str], steps: range) -> None:
    """Every job's steps in one transaction: a reader sees all of them or none."""
    pipe = client.pipeline(transaction=True)
    for name in names:
        for step in steps:
            event = StepEvent(
                role="trainer", gen=1, step=step, phase="finished", result="ok", gpu="GPU-0", ts=time.time()
            )
            xadd(pipe, stream_key(namespace, name), event)  # type: ignore[arg-type]
    pipe.execute()


def step_writes() -> float:
    return metrics.STATUS_WRITES.labels("steps")._value.get()


def last_steps(cluster: Any, namespace: str) -> dict[str, int | None]:
    items = get_json(cluster, "colocatejobs", "-n", namespace)["items"]
    return {
        i["metadata"]["name"]: ((i.get("status") or {}).get("weightSync") or {}).get("lastCompletedStep")
        for i in items
    }


READ_COMMANDS = ("evalsha", "eval", "xtrim", "type")  # the reader's bounded reads (and trims, type checks)
WAIT_COMMANDS = ("xread", "ping", "client|reply")  # its wait for new entries, on a connection of its own


def reader_connections(client: redis.Redis) -> int:
    """Connections to the store whose last command read, trimmed or waited for a stream (not the test's own
    writes and asks): the reader's read connection and its wait connection."""
    return sum(1 for c in client.client_list() if c.get("cmd") in READ_COMMANDS + WAIT_COMMANDS)


@pytest.mark.timeout(300)
def test_jobs_sharing_a_meta_store_share_one_reader_and_a_burst_costs_one_write(
    cluster: Any, namespace: str, crd: Any, redis_server: RedisServer
) -> None:
    names = create_jobs(cluster, namespace, redis_server, JOBS)
    client = redis_server.client()
    api = kube.Kube.from_environment()
    readers = Readers()
    trackers: dict[str, StepTracker] = {}

    async def until(probe: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            ended = [t for t in tasks if t.done()]
            if ended:
                raise AssertionError(f"a follower ended while waiting for {what}: {ended[0]!r}")
            await asyncio.sleep(0.2)

    def tracked(name: str) -> Callable[[StepTracker], None]:
        return lambda tracker: trackers.__setitem__(name, tracker)

    async def scenario() -> dict[str, float]:
        nonlocal tasks
        tasks = [
            asyncio.create_task(follow(namespace, n, api, CONFIG, readers=readers, on_tracker=tracked(n)))
            for n in names
        ]
        await until(lambda: len(trackers) == JOBS, 30, "every follower's tracker")
        await until(lambda: reader_connections(client) == 2, 30, "the shared reader's two connections")
        writes_before, xreads_before = step_writes(), readers.xreads()
        started = time.monotonic()
        await asyncio.to_thread(emit_steps, client, namespace, names, range(1, BURST + 1))
        await until(
            lambda: all(t.last_completed_step == BURST for t in trackers.values()), 30, "the burst read"
        )
        await until(
            lambda: set(last_steps(cluster, namespace).values()) == {BURST}, 60, f"step {BURST} in status"
        )
        caught_up = time.monotonic() - started
        figures = {
            "caught_up_s": caught_up,
            "writes": step_writes() - writes_before,
            "xreads": readers.xreads() - xreads_before,
            "readers": len(readers),
            "connections": reader_connections(client),
        }

        # A job joining while the reader waits (up to 10 s) is read at once, not after the wait.
        late = create_jobs(cluster, namespace, redis_server, JOBS + 1, secret=False)[-1]
        await asyncio.sleep(1)  # the reader is blocked again by now: nothing new on any stream
        tasks.append(
            asyncio.create_task(
                follow(namespace, late, api, CONFIG, readers=readers, on_tracker=tracked(late))
            )
        )
        await asyncio.to_thread(emit_steps, client, namespace, [late], range(1, 2))
        joined = time.monotonic()
        await until(lambda: late in trackers and trackers[late].last_completed_step == 1, 30, "the late job")
        figures["late_job_read_s"] = time.monotonic() - joined
        names.append(late)

        # Someone turns one job's stream key into a string: that job is let go (it retries), the rest go on.
        client.delete(stream_key(namespace, names[0]))
        client.set(stream_key(namespace, names[0]), "not a stream")
        await asyncio.to_thread(emit_steps, client, namespace, names[1:], range(BURST + 1, BURST + 2))
        await until(
            lambda: all(trackers[n].last_completed_step == BURST + 1 for n in names[1:]),
            30,
            "the other jobs' next step after one stream key broke",
        )
        await until(lambda: len(readers) == 1, 10, "one reader")
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)
        await until_closed()
        return figures

    async def until_closed() -> None:
        deadline = time.monotonic() + 10
        while len(readers) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    tasks: list[asyncio.Task[None]] = []
    figures = asyncio.run(scenario())
    print(f"\n{JOBS} jobs on one meta-store, a burst of {BURST} steps each: {figures}")
    assert figures["readers"] == 1 and figures["connections"] == 2, "one reader: a read and a wait connection"
    assert figures["writes"] == JOBS, "a burst of steps costs each job one status write"
    assert figures["xreads"] <= 3 * BURST, "reads are shared, not one per job and step"
    assert figures["caught_up_s"] < 10
    assert figures["late_job_read_s"] < 5, "a joining job interrupts the wait"
    assert len(readers) == 0, "the last follower to stop closes the reader"
