"""A meta-store that a job's own container paused (`CLIENT PAUSE`) holds back that job only (review issue 30,
item 1), on the real control plane with real redis-servers: five jobs suspend while their stores are paused,
so every pass of theirs reads and writes checkpoint records that never answer; a sixth job, created then,
still reaches Running in the time a job takes on an idle operator. Before the fix those reads ran on the four
shared reconcile workers, blocked for tens of seconds each (socket timeouts times redis-py's retries), and
the sixth job waited for a free worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer, redis_binary
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, condition, job_status, wait_phase

pytestmark = pytest.mark.integration
PAUSED_JOBS = 5
PAUSE_MS = 300_000  # longer than the test: the stores answer nothing until they are stopped
# A job on an idle operator reaches Running in 2-5 s here; a worker held by a paused store took 30 s or more.
RUNNING_WITHIN_SECONDS = 15.0


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[RedisServer]]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found (install Debian's redis-server or set COLOCATE_REDIS_SERVER)")
    servers: list[RedisServer] = []
    try:
        for i in range(PAUSED_JOBS + 1):
            workdir = tmp_path / f"redis-{i}"
            workdir.mkdir()
            servers.append(RedisServer(workdir, binary).start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def start_job(cluster: Any, namespace: str, name: str, server: RedisServer, **override: Any) -> None:
    metastore_secret(cluster, namespace, server, name=f"{name}-ms")
    apply_job(
        cluster,
        namespace,
        name=name,
        numNodes=1,
        gpusPerNode=1,
        metaStore=external_metastore(server, secret=f"{name}-ms"),
        **override,
    )


def step_in_flight(client: redis.Redis, namespace: str, name: str) -> None:
    """Step 1 done and step 2's weights on their way: a suspend then waits for the sync in flight."""
    for step, phase in ((1, "finished"), (2, "published")):
        event = StepEvent(
            role="trainer",
            gen=1,
            step=step,
            phase=phase,
            result="ok" if phase == "finished" else "",
            gpu="GPU-a",
            bytes=1000,
            weight_version=str(step),
            ts=time.time(),
        )
        xadd(client, stream_key(namespace, name), event)


def test_paused_meta_stores_of_five_suspending_jobs_do_not_hold_back_a_sixth_job(
    cluster: Any, namespace: str, operator_process: OperatorProcess, stores: list[RedisServer]
) -> None:
    paused = [f"paused-{i}" for i in range(PAUSED_JOBS)]
    for name, server in zip(paused, stores, strict=False):
        start_job(cluster, namespace, name, server, runPolicy={"suspendGracePeriodSeconds": 600})
    for name, server in zip(paused, stores, strict=False):
        wait_phase(cluster, namespace, "Running", name=name)
        step_in_flight(server.client(), namespace, name)
    for name in paused:
        wait_for(
            lambda name=name: (
                job_status(cluster, namespace, name).get("weightSync", {}).get("currentPhase") == "Publishing"
            ),
            30,
            f"step 2 in flight in the status of {name}",
        )

    # Each job's store stops answering (as `CLIENT PAUSE` from one of its own containers does), then the
    # jobs are suspended: every pass of theirs now reads the checkpoint records of a store that is paused.
    for server in stores[:PAUSED_JOBS]:
        assert server.client().execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL") in (b"OK", "OK", True)
    for name in paused:
        patch = json.dumps({"spec": {"suspend": True}})
        cluster.kubectl("patch", "colocatejob", name, "-n", namespace, "--type=merge", "-p", patch)
    time.sleep(3)  # their passes are running (and, before the fix, holding every worker)

    began = time.monotonic()
    start_job(cluster, namespace, "sixth", stores[PAUSED_JOBS])
    wait_phase(cluster, namespace, "Running", name="sixth", timeout=120)
    took = time.monotonic() - began
    print(f"\n[stall] the sixth job reached Running {took:.1f} s after it was created")
    assert took < RUNNING_WITHIN_SECONDS, (
        f"the sixth job took {took:.1f} s to reach Running while {PAUSED_JOBS} other jobs' meta-stores were "
        f"paused (an idle operator takes 2-5 s): their checkpoint I/O holds the shared reconcile workers"
    )

    # The paused jobs are still being looked after: Suspending, waiting for the sync in flight, and saying
    # that their store does not answer.
    for name in paused:
        status = wait_for(
            lambda name=name: (
                (s := job_status(cluster, namespace, name)).get("phase") == "Suspending"
                and "meta-store" in condition(s, "Suspended").get("message", "")
                and s
            ),
            30,
            f"{name} Suspending, its condition naming the meta-store that does not answer",
        )
        assert condition(status, "Suspended")["reason"] == "WaitingForCheckpoint"
