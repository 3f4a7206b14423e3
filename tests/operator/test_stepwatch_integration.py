"""Step events -> ColocateJob status on the real control plane: the operator follows the job's stream in a
real Redis and turns it into weightSync, recentSteps, WeightSyncHealthy, Progressing, Events and metrics."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, get_json, metastore_secret, wait_for
from tests.operator.factories import body
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import wait_condition

pytestmark = pytest.mark.integration

GPUS = ("GPU-a", "GPU-b")


def start_job(cluster: Any, namespace: str, server: RedisServer, **weight_sync: Any) -> None:
    metastore_secret(cluster, namespace, server)
    manifest = body(
        "steps",
        namespace,
        numNodes=2,
        gpusPerNode=1,
        metaStore=external_metastore(server),
        weightSync={"historyLimit": 3, **weight_sync},
    )
    manifest["metadata"] = {"name": "steps", "namespace": namespace}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def status(cluster: Any, namespace: str) -> dict[str, Any]:
    return get_json(cluster, "colocatejob", "steps", "-n", namespace).get("status") or {}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def emit(
    client: redis.Redis, namespace: str, step: int, gpu: str, phase: str = "finished", **fields: Any
) -> None:
    fields.setdefault("result", "ok" if phase in ("finished", "final") else "")
    event = StepEvent(
        role="trainer",
        gen=1,
        step=step,
        phase=phase,
        gpu=gpu,
        seconds=0.01 * step,
        bytes=1000,
        weight_version=str(step),
        ts=time.time(),
        **fields,
    )
    xadd(client, stream_key(namespace, "steps"), event)


def step_writes(operator: OperatorProcess) -> float:
    match = re.search(r'colocate_status_writes_total\{writer="steps"\} ([0-9.e+]+)', operator.metrics())
    return float(match.group(1)) if match else 0.0


def test_steps_failures_and_the_final_record_reach_status(
    cluster: Any,
    namespace: str,
    operator_process: OperatorProcess,
    redis_server: RedisServer,
) -> None:
    start_job(cluster, namespace, redis_server)
    client = redis_server.client()

    emit(client, namespace, 1, GPUS[0])
    time.sleep(2)
    assert "lastCompletedStep" not in status(cluster, namespace).get("weightSync", {}), (
        "one GPU is not a step"
    )
    emit(client, namespace, 1, GPUS[1])
    st = wait_for(
        lambda: (s := status(cluster, namespace)).get("weightSync", {}).get("lastCompletedStep") == 1 and s,
        30,
        "step 1 in status",
    )
    assert st["weightSync"]["lastSyncBytes"] == 2000 and st["weightSync"]["weightVersion"] == "1"
    # The status fields are ours by name in managedFields (the API server takes the User-Agent's name).
    fields = get_json(cluster, "colocatejob", "steps", "-n", namespace, "--show-managed-fields")
    managers = {(m["manager"], m.get("subresource")) for m in fields["metadata"]["managedFields"]}
    assert ("colocate-operator", "status") in managers, managers
    assert condition(st, "WeightSyncHealthy")["reason"] == "StepSucceeded"
    assert condition(st, "Progressing")["status"] == "True"

    # Garbage on the stream is skipped, not fatal; the history keeps the newest historyLimit steps.
    client.xadd(stream_key(namespace, "steps"), {"v": "1", "role": "nobody"})
    for step in range(2, 6):
        for gpu in GPUS:
            emit(client, namespace, step, gpu)
    st = wait_for(
        lambda: (s := status(cluster, namespace)).get("weightSync", {}).get("lastCompletedStep") == 5 and s,
        30,
        "step 5 in status",
    )
    assert [r["step"] for r in st["recentSteps"]] == [3, 4, 5]
    assert all(r["result"] == "Succeeded" for r in st["recentSteps"])
    # Coalesced: at most one write per step boundary (5 here), plus heartbeats, never one per event.
    assert step_writes(operator_process) <= 5 + 2

    emit(client, namespace, 6, GPUS[1], phase="failed", result="timeout", error="no ACK within 120 s")
    st = wait_condition(cluster, namespace, "WeightSyncHealthy", "False", name="steps")
    healthy = condition(st, "WeightSyncHealthy")
    assert (
        healthy["reason"] == "StepFailed" and "GPU-b" in healthy["message"] and "no ACK" in healthy["message"]
    )
    assert st["recentSteps"][-1]["result"] == "Failed"
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=steps")[
        "items"
    ]
    assert any(e["reason"] == "StepFailed" and e["type"] == "Warning" for e in events)
    assert any(e["reason"] == "StepCompleted" for e in events)

    # The final record is what success needs; pods still Running keep the job Running.
    emit(client, namespace, 6, GPUS[0], phase="final", final=True)
    st = wait_for(
        lambda: (s := status(cluster, namespace)).get("weightSync", {}).get("finalStepRecorded") and s,
        30,
        "finalStepRecorded",
    )
    assert condition(st, "Progressing")["reason"] == "TrainingFinished"
    assert st["phase"] == "Running"
    metrics = operator_process.metrics()
    assert (
        'colocate_last_completed_step{job="steps"' in metrics
        and "colocate_weight_sync_seconds_bucket" in metrics
    )


def test_no_step_within_the_progress_deadline_is_a_stall(
    cluster: Any,
    namespace: str,
    operator_process: OperatorProcess,
    redis_server: RedisServer,
) -> None:
    start_job(cluster, namespace, redis_server, progressDeadlineSeconds=3)
    client = redis_server.client()
    for gpu in GPUS:
        emit(client, namespace, 1, gpu)
    st = wait_for(
        lambda: (
            (s := status(cluster, namespace))
            and condition(s, "Progressing").get("reason") == "StepStalled"
            and s
        ),
        30,
        "Progressing=False/StepStalled",
    )
    assert condition(st, "Progressing")["status"] == "False"
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=steps")[
        "items"
    ]
    assert any(e["reason"] == "StepStalled" for e in events)
    for gpu in GPUS:  # a new step ends the stall
        emit(client, namespace, 2, gpu)
    wait_for(
        lambda: condition(status(cluster, namespace), "Progressing").get("reason") == "StepCompleted",
        30,
        "Progressing back to True after a new step",
    )
