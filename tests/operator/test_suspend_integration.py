"""Suspend at a step boundary on the real control plane (apiserver, scheduler, kwok) with a real Redis: a job
suspended in the middle of a weight sync keeps its pods until the step finished and the trainer (the runtime's
CheckpointRequests against that Redis, run by the test) checkpointed; status and Events say after which step;
the resumed trainer gets that step back and the step follower counts only the steps after it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.checkpoint import CheckpointRequests
from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.contract.checkpoint import CheckpointKeys
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    condition,
    events,
    job_status,
    pods,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration
GPUS = ("GPU-a", "GPU-b")


def start(cluster: Any, namespace: str, server: RedisServer, grace: int, deadline: int = 3600) -> None:
    metastore_secret(cluster, namespace, server)
    apply_job(
        cluster,
        namespace,
        numNodes=2,
        gpusPerNode=1,
        metaStore=external_metastore(server),
        runPolicy={"suspendGracePeriodSeconds": grace},
        weightSync={"progressDeadlineSeconds": deadline},
    )
    wait_phase(cluster, namespace, "Running")
    running_pods(cluster, namespace, 2, 0)


def suspend(cluster: Any, namespace: str, value: bool) -> None:
    patch = json.dumps({"spec": {"suspend": value}})
    cluster.kubectl("patch", "colocatejob", "demo", "-n", namespace, "--type=merge", "-p", patch)


def emit(client: Any, namespace: str, step: int, phase: str, gen: int = 1) -> None:
    for gpu in GPUS:
        event = StepEvent(
            role="trainer",
            gen=gen,
            step=step,
            phase=phase,
            result="ok" if phase == "finished" else "",
            gpu=gpu,
            bytes=1000,
            weight_version=str(step),
            ts=time.time(),
        )
        xadd(client, stream_key(namespace, "demo"), event)


def trainers(server: RedisServer, namespace: str) -> tuple[list[CheckpointRequests], list[tuple[int, int]]]:
    """Two trainer ranks, registered for checkpoint requests; the callback records (rank, step)."""
    saved: list[tuple[int, int]] = []
    ranks = []
    for rank in (0, 1):
        address = MetaStoreAddress(server.host, server.port, server.password)
        store = MetaStore.connect(address, KeySchema(namespace, "demo"), key_ttl_s=60)
        requests = CheckpointRequests(store, lambda step, rank=rank: saved.append((rank, step)), rank=rank)
        requests.register()
        ranks.append(requests)
    return ranks, saved


def last_step(cluster: Any, namespace: str, step: int) -> dict[str, Any]:
    return wait_for(
        lambda: (
            (s := job_status(cluster, namespace)).get("weightSync", {}).get("lastCompletedStep") == step and s
        ),
        30,
        f"step {step} in status",
    )


def job_events(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    return [e for e in events(cluster, namespace) if e["involvedObject"]["kind"] == "ColocateJob"]


def test_suspend_mid_step_waits_for_the_checkpoint_and_resume_continues_after_it(
    cluster: Any, namespace: str, operator_process: OperatorProcess, redis_server: RedisServer
) -> None:
    start(cluster, namespace, redis_server, grace=60)
    client = redis_server.client()
    ranks, saved = trainers(redis_server, namespace)
    for step in (1, 2, 3):
        emit(client, namespace, step, "published")
        emit(client, namespace, step, "finished")
    last_step(cluster, namespace, 3)
    emit(client, namespace, 4, "published")  # step 4's weights are on their way

    began = time.monotonic()
    suspend(cluster, namespace, True)
    status = wait_phase(cluster, namespace, "Suspending", timeout=30)
    waiting = condition(status, "Suspended")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForCheckpoint")
    keys = CheckpointKeys(namespace, "demo")
    wait_for(lambda: client.get(keys.request), 15, "the checkpoint request in the meta-store")
    time.sleep(3)  # the operator looks again every 2 s: the pods must still be there
    assert [p["metadata"].get("deletionTimestamp") for p in pods(cluster, namespace)] == [None, None]
    assert (
        "0/2 trainer ranks acknowledged" in condition(job_status(cluster, namespace), "Suspended")["message"]
    )

    # Step 4 finishes; at its boundary both ranks see the request, checkpoint and acknowledge.
    emit(client, namespace, 4, "finished")
    assert [requests.at_step_boundary(4) for requests in ranks] == [True, True]
    assert saved == [(0, 4), (1, 4)]
    status = wait_phase(cluster, namespace, "Suspended", timeout=30)
    wait_for(lambda: not pods(cluster, namespace), 30, "pods deleted after the checkpoint")
    assert time.monotonic() - began < 45, "deleted on the ACK, not at the end of the grace period"
    suspension = status["suspension"]
    assert suspension["outcome"] == "Checkpointed" and suspension["checkpointRequested"] is True
    assert suspension["checkpointStep"] == 4 and suspension["afterStep"] == 4
    message = condition(status, "Suspended")["message"]
    assert condition(status, "Suspended")["status"] == "True"
    assert "pods deleted after step 4 (the trainer checkpointed after step 4)" in message
    said = {e["reason"]: e["message"] for e in job_events(cluster, namespace)}
    assert "Suspending" in said and "after step 4" in said["SuspendedByUser"]

    # Resume: the request is withdrawn before the pods exist; the new trainer resumes after step 4.
    suspend(cluster, namespace, False)
    wait_phase(cluster, namespace, "Running")
    running_pods(cluster, namespace, 2, 0)
    assert client.get(keys.request) is None
    resumed, saved = trainers(redis_server, namespace)
    assert [requests.resume_step() for requests in resumed] == [4, 4]
    emit(client, namespace, 4, "finished", gen=2)  # a redone step is not new
    emit(client, namespace, 5, "published", gen=2)
    emit(client, namespace, 5, "finished", gen=2)
    assert [requests.at_step_boundary(5) for requests in resumed] == [False, False] and saved == []
    status = last_step(cluster, namespace, 5)
    assert [r["step"] for r in status["recentSteps"]][-3:] == [3, 4, 5]
    assert status["restarts"] == 0 and status["suspension"]["checkpointStep"] == 4


def test_a_trainer_that_never_answers_is_stopped_when_the_grace_period_ends(
    cluster: Any, namespace: str, operator_process: OperatorProcess, redis_server: RedisServer
) -> None:
    start(cluster, namespace, redis_server, grace=4, deadline=15)
    client = redis_server.client()
    trainers(redis_server, namespace)  # registered, but never at a step boundary again
    for step in (1, 2):
        emit(client, namespace, step, "finished")
    last_step(cluster, namespace, 2)
    progressed = time.monotonic()
    emit(client, namespace, 3, "published")

    suspend(cluster, namespace, True)
    wait_phase(cluster, namespace, "Suspending", timeout=30)
    status = wait_phase(cluster, namespace, "Suspended", timeout=30)
    wait_for(lambda: not pods(cluster, namespace), 30, "pods deleted when the grace period ended")
    assert status["suspension"]["outcome"] == "GracePeriodExpired"
    assert status["suspension"]["afterStep"] == 2 and "checkpointStep" not in status["suspension"]
    message = condition(status, "Suspended")["message"]
    assert "after step 2" in message and "grace period ran out" in message
    warned = [e for e in job_events(cluster, namespace) if e["reason"] == "SuspendedByUser"]
    assert warned and warned[0]["type"] == "Warning"

    # Suspended past progressDeadlineSeconds (15 s after step 2): a suspended job is not a stalled one.
    time.sleep(max(0.0, progressed + 20 - time.monotonic()))
    progressing = condition(job_status(cluster, namespace), "Progressing")
    assert progressing["status"] == "True", progressing
    assert "StepStalled" not in {e["reason"] for e in job_events(cluster, namespace)}
