"""Fixtures for the operator's integration tests: the CRD installed once, the operator as a subprocess that
runs under the Helm chart's own ServiceAccount and RBAC (not as cluster admin), so a verb the chart lacks
fails a test: the request is refused, and the fixture fails any test whose operator log shows a refusal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.kueue import Kueue
from colocate_devcluster.processes import free_port
from tests.kube import ChartIdentity, chart_identity, forbidden_lines
from tests.operator import kueue_setup

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"


class OperatorProcess:
    """`python -m colocate_operator` watching one namespace as the chart runs it (its ServiceAccount's token,
    its container's environment), its JSON log kept in a file."""

    def __init__(
        self, namespace: str, log_path: Path, identity: ChartIdentity, args: tuple[str, ...] = (), **env: str
    ) -> None:
        self.namespace = namespace
        self.args = args  # more command-line options, as the chart's values render them
        self.log_path = log_path
        self.identity = identity
        self.env = {
            **identity.env,
            "COLOCATE_RECONCILE_INTERVAL_SECONDS": "2",
            **env,
            "KUBECONFIG": str(identity.kubeconfig),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.port = self.metrics_port = 0

    def start(self, timeout: float = 60, **env: str) -> OperatorProcess:
        self.port, self.metrics_port = free_port(), free_port()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "colocate_operator",
                    "--namespace",
                    self.namespace,
                    "--liveness",
                    f"http://127.0.0.1:{self.port}/healthz",
                    f"--metrics-port={self.metrics_port}",
                    *self.args,
                ],
                cwd=ROOT,
                env={**os.environ, **self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"operator exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"operator not live after {timeout} s:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind, as when a node dies."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture(scope="session")
def crd(cluster) -> Path:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/colocatejobs.colocate.dev")
    return CRD_PATH


# What the chart is installed with in these tests: the External meta-stores the tests use (the real Redis
# servers on loopback, the address that waits for its Secret) and nothing else.
TEST_CHART_VALUES = (
    "--set",
    "externalMetaStore.allowedAddresses={127.0.0.1/32,redis.shared.svc.cluster.local:6379}",
)


@pytest.fixture
def operator_identity(cluster: Cluster, crd: Path, namespace: str, tmp_path: Path) -> ChartIdentity:
    """The chart's ServiceAccount, RBAC for this test's namespace, and a token for it."""
    return chart_identity(cluster, namespace, tmp_path, *TEST_CHART_VALUES)


@pytest.fixture
def operator_process(
    namespace: str, tmp_path: Path, operator_identity: ChartIdentity
) -> Iterator[OperatorProcess]:
    """A started operator for this test's namespace; stopped (and its log printed on failure) afterwards.
    A request the chart's RBAC refused fails the test even when the operator survived it."""
    process = OperatorProcess(namespace, tmp_path / "operator.log", operator_identity).start()
    yield process
    process.stop()
    print(f"\n[operator log: {process.log_path}]\n{process.log()[-3000:]}", file=sys.stderr)
    refused = forbidden_lines(process.log())
    assert not refused, "the chart's RBAC refused the operator:\n" + "\n".join(refused[:10])


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Kueue:
    """Kueue for this session's cluster, started by the first module that asks and left running with it."""
    return kueue_setup.started_kueue(cluster)


@pytest.fixture
def quota(cluster: Cluster, kueue: Kueue, namespace: str) -> Iterator[kueue_setup.Quota]:
    """Quota for exactly one job in the test's namespace; removed, jobs first, while Kueue still runs."""
    yield from kueue_setup.quota_for(cluster, namespace)
