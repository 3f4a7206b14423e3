"""Kueue preemption stops a job at a step boundary, on the real plane with real Kueue and a real Redis: the
preempted job keeps its pods while its weight sync finishes and its trainer (the runtime's CheckpointRequests,
run by the test) checkpoints, then goes Suspended after that step with Kueue's reason, and the higher
priority job runs once the quota is handed back."""

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
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.kueue_setup import GPUS, NODES, QUEUE, Quota
from tests.operator.test_integration import condition, job_manifest, job_status, pods, wait_phase
from tests.operator.test_kueue_integration import running, submit

pytestmark = pytest.mark.integration


def priority_classes(cluster: Any, made: Quota, namespace: str) -> tuple[str, str]:
    low, high = f"low-{namespace}", f"high-{namespace}"
    for klass, value in ((low, 100), (high, 1000)):
        made.priority_classes.append(klass)
        cluster.apply(
            [
                {
                    "apiVersion": "kueue.x-k8s.io/v1beta2",
                    "kind": "WorkloadPriorityClass",
                    "metadata": {"name": klass},
                    "value": value,
                }
            ]
        )
    return low, high


def emit(client: Any, namespace: str, step: int, phase: str) -> None:
    for gpu in range(NODES * GPUS):
        event = StepEvent(
            role="trainer",
            gen=1,
            step=step,
            phase=phase,
            result="ok" if phase == "finished" else "",
            gpu=f"GPU-{gpu}",
            ts=time.time(),
        )
        xadd(client, stream_key(namespace, "low"), event)


def test_kueue_preemption_waits_for_the_step_and_the_checkpoint(
    cluster: Any,
    namespace: str,
    quota: Quota,
    operator_process: OperatorProcess,
    redis_server: RedisServer,
) -> None:
    low, high = priority_classes(cluster, quota, namespace)
    metastore_secret(cluster, namespace, redis_server)
    manifest = job_manifest(
        "low",
        namespace,
        numNodes=NODES,
        gpusPerNode=GPUS,
        gpu={"allocation": "DevicePlugin"},
        metaStore=external_metastore(redis_server),
        runPolicy={"suspendGracePeriodSeconds": 60},
    )
    manifest["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": QUEUE,
        "kueue.x-k8s.io/priority-class": low,
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    running(cluster, namespace, "low")
    wait_phase(cluster, namespace, "Running", name="low")

    address = MetaStoreAddress(redis_server.host, redis_server.port, redis_server.password)
    store = MetaStore.connect(address, KeySchema(namespace, "low"), key_ttl_s=60)
    saved: list[int] = []
    trainer = CheckpointRequests(store, saved.append)  # one registered rank stands for the trainer
    trainer.register()
    client = redis_server.client()
    emit(client, namespace, 1, "finished")
    wait_for(
        lambda: job_status(cluster, namespace, "low").get("weightSync", {}).get("lastCompletedStep") == 1,
        30,
        "step 1 in status",
    )
    emit(client, namespace, 2, "published")

    submit(cluster, namespace, "high", high)
    status = wait_phase(cluster, namespace, "Suspending", name="low", timeout=60)
    assert condition(status, "Suspended")["reason"] == "WaitingForCheckpoint"
    time.sleep(3)
    assert len(pods(cluster, namespace, "low")) == NODES, "the step in flight keeps the pods"
    assert pods(cluster, namespace, "high") == [], "the quota is not handed over before the pods are gone"

    emit(client, namespace, 2, "finished")
    assert trainer.at_step_boundary(2) and saved == [2]
    status = wait_phase(cluster, namespace, "Suspended", name="low", timeout=60)
    assert status["suspension"]["outcome"] == "Checkpointed" and status["suspension"]["afterStep"] == 2
    stopped = condition(status, "Suspended")
    assert stopped["reason"] == "EvictedByKueue" and "after step 2" in stopped["message"]
    wait_for(lambda: pods(cluster, namespace, "low") == [], 60, "the preempted job's pods gone")
    running(cluster, namespace, "high")
