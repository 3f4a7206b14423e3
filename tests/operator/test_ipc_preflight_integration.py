"""IPC preflight events -> IPCReady on the real control plane, and `ipcPreflight.mode: Fail` failing the job
(the runtime's side is in tests/runtime/test_colocated_preflight.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, get_json, metastore_secret, wait_for
from tests.operator.factories import body
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import wait_condition

pytestmark = pytest.mark.integration


def start_job(cluster: Any, namespace: str, name: str, server: RedisServer, mode: str) -> None:
    manifest = body(
        name,
        namespace,
        numNodes=2,
        gpusPerNode=1,
        metaStore=external_metastore(server),
        weightSync={"ipcPreflight": {"mode": mode}},
    )
    manifest["metadata"] = {"name": name, "namespace": namespace}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def status(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    return get_json(cluster, "colocatejob", name, "-n", namespace).get("status") or {}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def preflight(client: redis.Redis, namespace: str, job: str, gpu: str, result: str, reason: str = "") -> None:
    event = StepEvent(
        role="trainer",
        gen=1,
        step=0,
        phase="preflight",
        result=result,
        reason=reason,
        gpu=gpu,
        error=f"probe file not in /dev/shm on {gpu}" if result == "error" else "",
        ts=time.time(),
    )
    xadd(client, stream_key(namespace, job), event)


def test_ipc_ready_in_status_and_fail_mode_fails_the_job(
    cluster: Any,
    namespace: str,
    operator_process: OperatorProcess,
    redis_server: RedisServer,
) -> None:
    metastore_secret(cluster, namespace, redis_server)
    start_job(cluster, namespace, "pf-wait", redis_server, "Wait")
    start_job(cluster, namespace, "pf-fail", redis_server, "Fail")
    client = redis_server.client()

    # Wait mode: pending, then a failure that only reports, then every GPU passed.
    preflight(client, namespace, "pf-wait", "GPU-a", "ok", ev.PREFLIGHT_PASSED)
    st = wait_for(
        lambda: (s := status(cluster, namespace, "pf-wait")) and condition(s, "IPCReady") and s,
        30,
        "IPCReady",
    )
    assert condition(st, "IPCReady")["reason"] == "PreflightPending"
    preflight(client, namespace, "pf-wait", "GPU-b", "error", ev.SHM_NOT_SHARED)
    wait_for(
        lambda: condition(status(cluster, namespace, "pf-wait"), "IPCReady").get("reason") == "ShmNotShared",
        30,
        "IPCReady=False/ShmNotShared",
    )
    preflight(client, namespace, "pf-wait", "GPU-b", "ok", ev.PREFLIGHT_PASSED)
    st = wait_condition(cluster, namespace, "IPCReady", "True", name="pf-wait")
    assert condition(st, "IPCReady")["reason"] == "PreflightPassed"
    assert st.get("phase") != "Failed"

    # Fail mode: the first failure fails the job.
    preflight(client, namespace, "pf-fail", "GPU-a", "error", ev.DEVICE_UUID_MISMATCH)
    st = wait_for(
        lambda: (s := status(cluster, namespace, "pf-fail")).get("phase") == "Failed" and s,
        30,
        "pf-fail Failed",
    )
    failed = condition(st, "Failed")
    assert failed["reason"] == "IPCPreflightFailed" and "DeviceUUIDMismatch" in failed["message"]
    assert condition(st, "IPCReady")["reason"] == "DeviceUUIDMismatch"
    assert status(cluster, namespace, "pf-wait").get("phase") != "Failed"
