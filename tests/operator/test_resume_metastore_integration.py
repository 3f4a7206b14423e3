"""Resume while the meta-store's Secret is gone (issue 30, item 5), on the real control plane with a real
redis-server: a suspend asked the trainers for a checkpoint, so the resume must withdraw that request from
the store before the new pods exist. That withdraw used to run before anything the plan creates and to raise
while the store could not be reached, so a Secret deleted while the job was suspended was never created
again, no pod either, and status said nothing: the job stayed Suspended for good. Now the resume creates the
meta-store's children first, holds back only the pods (a condition says why) and creates them once the
request is withdrawn.

What stands in (as in test_metastore_loss_integration.py): kwok runs no containers, so a redis-server started
here on the Managed Service's name (`dns_standin` resolves it to a loopback address) plays the Redis pod, and
the operator restarting that pod on the new Secret is paired with restarting the server on the new password,
empty, as the new pod starts."""

from __future__ import annotations

import base64
import json
import os
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer, redis_binary
from colocate_runtime.contract.checkpoint import CheckpointKeys
from tests.kube import ChartIdentity, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import condition, get, job_manifest, job_status, pods, wait_phase
from tests.operator.test_suspend_integration import suspend, trainers

pytestmark = pytest.mark.integration

DNS_STANDIN = Path(__file__).resolve().parent / "dns_standin"
REDIS_PORT = 6379


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def secret(cluster: Any, namespace: str, name: str) -> dict[str, Any] | None:
    found = get(cluster, namespace, "secrets", "--field-selector", f"metadata.name={name}")["items"]
    return found[0] if found else None


def password(body: dict[str, Any]) -> str:
    return base64.b64decode(body["data"]["password"]).decode()


@pytest.mark.timeout(300)
def test_a_secret_deleted_while_suspended_is_recreated_on_resume_and_the_job_runs(
    cluster: Any, namespace: str, tmp_path: Path, operator_identity: ChartIdentity, stack: ExitStack
) -> None:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found (install Debian's redis-server or set COLOCATE_REDIS_SERVER)")
    service_ip = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    dns = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(DNS_STANDIN), os.environ.get("PYTHONPATH")])),
        "COLOCATE_TEST_SERVICE_IP": service_ip,
    }
    operator = OperatorProcess(namespace, tmp_path / "operator.log", operator_identity, **dns).start()
    stack.callback(operator.stop)
    manifest = job_manifest(
        "demo", namespace, numNodes=1, gpusPerNode=1, runPolicy={"suspendGracePeriodSeconds": 3}
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    wait_phase(cluster, namespace, "Running", timeout=60)
    secret_name = job_status(cluster, namespace)["metaStore"]["secretName"]
    first = secret(cluster, namespace, secret_name)
    assert first is not None
    server = RedisServer(tmp_path, binary, host=service_ip, port=REDIS_PORT, password=password(first))
    server.start()
    stack.callback(server.stop)
    trainers(server, namespace)  # registered for checkpoint requests, never answering

    # Suspend: the operator writes the checkpoint request; the grace period runs out; the pods go.
    suspend(cluster, namespace, True)
    status = wait_phase(cluster, namespace, "Suspended", timeout=60)
    assert status["suspension"]["checkpointRequested"] is True
    request_key = CheckpointKeys(namespace, "demo").request
    assert server.client().exists(request_key), "the request a resumed trainer must not see"
    wait_for(lambda: not pods(cluster, namespace) or None, 30, "the pods deleted")

    cluster.kubectl("delete", "secret", secret_name, "-n", namespace)
    resumed = time.monotonic()
    suspend(cluster, namespace, False)
    recreated = wait_for(
        lambda: (
            (s := secret(cluster, namespace, secret_name))
            and s["metadata"]["uid"] != first["metadata"]["uid"]
            and s
        ),
        60,
        "the meta-store Secret created again on resume",
    )
    # Until the request is withdrawn (the old Redis does not take the new password), no pod, and status
    # says why.
    waiting = wait_for(
        lambda: (
            (c := condition(job_status(cluster, namespace), "Suspended")).get("reason")
            == "CheckpointRequestNotWithdrawn"
            and c
        ),
        30,
        "a condition saying the pods wait for the withdraw",
    )
    assert waiting["status"] == "False" and "meta-store" in waiting["message"], waiting
    assert not pods(cluster, namespace)

    # The Redis pod restarts on the new Secret (the operator deletes it): its stand-in comes back empty,
    # with the new password.
    server.stop()
    server.password = password(recreated)
    server.start()
    status = wait_phase(cluster, namespace, "Running", timeout=60)
    took = time.monotonic() - resumed
    print(f"\nresumed with the Secret deleted: Running {took:.1f} s after the resume")
    assert len(pods(cluster, namespace)) == 1
    assert condition(status, "Suspended")["reason"] == "NotSuspended"
    assert not server.client().exists(request_key)
    assert "MetaStorePasswordChanged" in {e["reason"] for e in get(cluster, namespace, "events")["items"]}
