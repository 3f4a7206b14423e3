"""External meta-stores on the real control plane (M9): the operator started as the chart runs it (allow-list
127.0.0.1/32 and redis.shared.svc.cluster.local:6379, tests/operator/conftest.py) refuses a job that names
another address: a condition naming the address and the chart value, no pods, and not one connection to that
address (a listener there would have received the job's password in an AUTH)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from colocate_devcluster import Cluster
from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, condition, job_status, pods

pytestmark = pytest.mark.integration


class Listener:
    """A TCP port that records whatever connects to it (a stand-in for an attacker's fake Redis)."""

    def __init__(self, host: str) -> None:
        self.socket = socket.create_server((host, 0))
        self.socket.settimeout(0.2)
        self.address = f"{host}:{self.socket.getsockname()[1]}"
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.socket.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(4096) or b"(connected)")
                except OSError:
                    self.received.append(b"(connected)")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener("127.0.0.2")  # loopback, but outside the allowed 127.0.0.1/32
    yield server
    server.close()


def test_an_external_address_not_allowed_is_refused_and_never_dialled(
    cluster: Cluster, namespace: str, operator_process: OperatorProcess, listener: Listener
) -> None:
    password = "s3cret-not-for-strangers"
    cluster.kubectl(
        "create", "secret", "generic", "ms", "-n", namespace, f"--from-literal=password={password}"
    )
    external = {
        "mode": "External",
        "external": {"address": listener.address, "passwordSecretRef": {"name": "ms"}},
    }
    apply_job(cluster, namespace, metaStore=external)
    meta = wait_for(
        lambda: (
            (c := condition(job_status(cluster, namespace), "MetaStoreReady")).get("reason")
            == "ExternalAddressNotAllowed"
            and c
        ),
        60,
        "MetaStoreReady=False/ExternalAddressNotAllowed",
    )
    assert meta["status"] == "False"
    assert listener.address in meta["message"] and "externalMetaStore.allowedAddresses" in meta["message"]
    time.sleep(6)  # several passes (resync every 2 s) and any step follower's first connection attempts
    assert pods(cluster, namespace) == []
    assert job_status(cluster, namespace)["phase"] == "Pending"
    assert listener.received == [], "the operator dialled an address it was not allowed to"
    assert password not in operator_process.log()
