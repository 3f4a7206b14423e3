"""The step stream is untrusted input (H4, L8 of the security review), on the real control plane and a real
redis-server: the follower runs in this process (as in the operator), so the test can measure its state and
memory while another process floods the job's stream with hostile entries."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_operator import kube
from colocate_operator.config import OperatorConfig
from colocate_operator.step_follow import follow
from colocate_operator.steps import FAILED_STEPS_MAX, PENDING_STEPS_MAX, StepTracker, gpu_limit
from colocate_runtime.contract.events import STREAM_MAXLEN, stream_key
from tests.kube import get_json
from tests.operator.test_stepwatch_integration import GPUS, emit, start_job, status

pytestmark = pytest.mark.integration

# In-process followers dial the loopback test Redis: an operator allows only listed External addresses.
CONFIG = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})

FLOOD_ENTRIES = 200_000

# Run in its own process so that tracemalloc here sees only the follower. Raw XADDs, no MAXLEN: a writer that
# ignores the protocol. Five kinds of entry in turn: bad bytes, a valid event from a new GPU for a new step,
# fields over the codec's bounds, a valid failure of a new step, and garbage numbers.
FLOOD = r"""
import sys, redis
port, password, key, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = redis.Redis(host="127.0.0.1", port=int(port), password=password)
base = {"v": "1", "role": "trainer", "gen": "1", "phase": "finished", "result": "ok", "ts": "1.0"}
pipe = client.pipeline(transaction=False)
for i in range(total):
    kind = i % 5
    if kind == 0:
        fields = {**base, "step": "5", "gpu": b"\xff\xfe" + str(i).encode(), b"\xc3\x28": b"\x80"}
    elif kind == 1:
        fields = {**base, "step": str(1_000_000 + i), "gpu": f"GPU-evil-{i}"}
    elif kind == 2:
        fields = {**base, "step": str(i), "gpu": "G" * 1500, "error": "e" * 1500}
    elif kind == 3:
        fields = {**base, "phase": "failed", "result": "error", "step": str(3_000_000 + i),
                  "gpu": f"GPU-evil-{i}", "error": "x" * 500}
    else:
        fields = {**base, "step": ("-1", "nan", "9" * 5000, "[[[")[i // 5 % 4], "seconds": "inf"}
    pipe.xadd(key, fields)
    if i % 1000 == 999:
        pipe.execute()
pipe.execute()
"""


@pytest.mark.timeout(540)
def test_a_flood_of_hostile_entries_leaves_the_follower_bounded_and_following(
    cluster: Any,
    namespace: str,
    crd: Any,
    redis_server: RedisServer,
) -> None:
    start_job(cluster, namespace, redis_server)
    client = redis_server.client()
    key = stream_key(namespace, "steps")
    api = kube.Kube.from_environment()
    trackers: list[StepTracker] = []

    async def until(probe: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            if task.done():
                raise AssertionError(f"the follower ended while waiting for {what}: {task!r}")
            await asyncio.sleep(0.2)

    async def scenario() -> tuple[int, float]:
        nonlocal task
        task = asyncio.create_task(follow(namespace, "steps", api, CONFIG, on_tracker=trackers.append))
        for gpu in GPUS:
            emit(client, namespace, 1, gpu)
        await until(lambda: bool(trackers) and trackers[0].last_completed_step == 1, 30, "step 1")
        tracemalloc.start()
        started = time.monotonic()
        flood = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FLOOD,
            str(redis_server.port),
            redis_server.password,
            key,
            str(FLOOD_ENTRIES),
        )
        assert await asyncio.wait_for(flood.wait(), 180) == 0, "the flood writer failed"
        for gpu in GPUS:  # the next real step, after every hostile entry
            emit(client, namespace, 2, gpu)
        await until(lambda: trackers[0].last_completed_step == 2, 240, "step 2 after the flood")
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        await until(
            lambda: status(cluster, namespace).get("weightSync", {}).get("lastCompletedStep") == 2,
            30,
            "step 2 in status",
        )
        task.cancel()
        return peak, elapsed

    task: asyncio.Task[None]
    peak, elapsed = asyncio.run(scenario())
    tracker = trackers[0]
    size = tracker.state_size()
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=steps")[
        "items"
    ]
    untrusted = [e for e in events if e["reason"] == "StepStreamUntrusted"]
    print(
        f"\nflood of {FLOOD_ENTRIES} hostile entries: follower state {size}, dropped {tracker.dropped}, "
        f"tracemalloc peak {peak / 2**20:.1f} MiB, {elapsed:.0f} s, stream length after "
        f"{client.xlen(key)}, {len(untrusted)} StepStreamUntrusted Event(s): "
        f"{[e['message'][:120] for e in untrusted]}"
    )
    assert size["gpus"] <= gpu_limit(2) and size["preflight_gpus"] == 0
    assert size["pending_steps"] <= PENDING_STEPS_MAX and size["failed_steps"] <= FAILED_STEPS_MAX
    assert size["recent"] <= 3 and tracker.dropped > 0
    assert peak < 32 * 2**20, f"the follower's memory peaked at {peak / 2**20:.1f} MiB"
    # Trimmed as it reads: the stream holds about STREAM_MAXLEN, not the 200k written without MAXLEN.
    assert client.xlen(key) <= STREAM_MAXLEN + 2000
    # Reported, rate-limited: one Event per minute at most, not one per bad entry.
    assert 1 <= len(untrusted) <= 2 + int(elapsed // 60)
    assert all(len(e["message"]) <= 1024 for e in untrusted)
    final = status(cluster, namespace)
    assert final["weightSync"]["lastCompletedStep"] == 2
    assert len(json.dumps(final)) < 64 * 1024


def test_the_follower_of_a_job_deleted_unseen_stops(cluster: Any, namespace: str, crd: Any) -> None:
    """L8: no watch event tells the follower (the operator missed the deletion in a watch gap); the Secret it
    waits for never comes. It must notice on its own that the job is gone, not retry forever."""
    manifest = {
        "apiVersion": "colocate.dev/v1alpha1",
        "kind": "ColocateJob",
        "metadata": {"name": "steps", "namespace": namespace},
        "spec": {
            "numNodes": 1,
            "gpusPerNode": 1,
            "model": {"arch": "qwen3"},
            "trainer": {"image": "example.com/trainer:1", "command": ["python", "-m", "train"]},
            "rollout": {"image": "example.com/sglang:1"},
            "metaStore": {
                "mode": "External",
                "external": {"address": "127.0.0.1:1", "passwordSecretRef": {"name": "missing"}},
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    api = kube.Kube.from_environment()

    async def scenario() -> None:
        task = asyncio.create_task(follow(namespace, "steps", api, CONFIG))
        await asyncio.sleep(2)
        assert not task.done(), "the follower waits for its Secret while the job exists"
        await asyncio.to_thread(cluster.kubectl, "delete", "colocatejob", "steps", "-n", namespace)
        try:
            await asyncio.wait_for(task, 20)
        except TimeoutError:
            raise AssertionError("the follower of a deleted job still runs 20 s later") from None

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_a_new_follower_trims_a_huge_stream_before_replaying_it(
    cluster: Any,
    namespace: str,
    crd: Any,
    redis_server: RedisServer,
) -> None:
    """Replay from 0-0 (an operator restart) of a stream a writer grew past MAXLEN: the follower trims it to
    about STREAM_MAXLEN first, so the replay is bounded, and the newest real step still reaches status."""
    start_job(cluster, namespace, redis_server)
    client = redis_server.client()
    key = stream_key(namespace, "steps")
    for gpu in GPUS:
        emit(client, namespace, 1, gpu)
    entries = 60_000
    subprocess.run(
        [sys.executable, "-c", FLOOD, str(redis_server.port), redis_server.password, key, str(entries)],
        check=True,
        timeout=180,
    )
    for gpu in GPUS:  # with MAXLEN ~, as the runtime writes: one approximate trim removes 10000 at most
        emit(client, namespace, 2, gpu)
    assert client.xlen(key) > entries // 2
    api = kube.Kube.from_environment()
    trackers: list[StepTracker] = []

    async def scenario() -> float:
        started = time.monotonic()
        task = asyncio.create_task(follow(namespace, "steps", api, CONFIG, on_tracker=trackers.append))
        deadline = started + 120
        while not (trackers and trackers[0].last_completed_step == 2):
            assert time.monotonic() < deadline and not task.done(), "step 2 not replayed within 120 s"
            await asyncio.sleep(0.1)
        task.cancel()
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    print(
        f"\nreplay of a {entries}-entry stream: step 2 after {elapsed:.1f} s, {client.xlen(key)} entries left"
    )
    assert client.xlen(key) <= STREAM_MAXLEN + 2000, "trimmed before the replay"


def test_the_follower_of_a_job_created_again_under_its_name_leaves_the_new_job_alone(
    cluster: Any,
    namespace: str,
    crd: Any,
    redis_server: RedisServer,
) -> None:
    """L8: the job is deleted and created again under the same name while the operator misses both watch
    events. The old follower (old spec, old tracker) must not write into the new job's status: it stops."""
    start_job(cluster, namespace, redis_server)
    manifest = get_json(cluster, "colocatejob", "steps", "-n", namespace)
    manifest["metadata"] = {"name": "steps", "namespace": namespace}
    manifest.pop("status", None)
    client = redis_server.client()
    api = kube.Kube.from_environment()

    async def scenario() -> None:
        task = asyncio.create_task(follow(namespace, "steps", api, CONFIG))
        for gpu in GPUS:
            emit(client, namespace, 1, gpu)
        deadline = time.monotonic() + 30
        while status(cluster, namespace).get("weightSync", {}).get("lastCompletedStep") != 1:
            assert time.monotonic() < deadline and not task.done(), "step 1 not in status within 30 s"
            await asyncio.sleep(0.3)
        await asyncio.to_thread(cluster.kubectl, "delete", "colocatejob", "steps", "-n", namespace)
        await asyncio.to_thread(cluster.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
        for gpu in GPUS:
            emit(client, namespace, 2, gpu)
        try:
            await asyncio.wait_for(task, 30)
        except TimeoutError:
            raise AssertionError(
                "the old job's follower still runs 30 s after the job was replaced"
            ) from None

    asyncio.run(scenario())
    assert "lastCompletedStep" not in status(cluster, namespace).get("weightSync", {}), (
        "the old follower wrote into the new job's status"
    )
