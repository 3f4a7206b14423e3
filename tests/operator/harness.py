"""The operator under test, shared by the integration tests and the soak run: its CRD, the chart values the
tests install it with, and `OperatorProcess`, the operator as a subprocess under the chart's own identity.
Plain helpers (no fixtures), so that a test module imports them by name rather than from a conftest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from colocate_devcluster import Cluster
from colocate_devcluster.processes import free_port
from tests.kube import ChartIdentity

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"

# What the chart is installed with in these tests: the External meta-stores the tests use (the real Redis
# servers on loopback, the address that waits for its Secret) and nothing else.
TEST_CHART_VALUES = (
    "--set",
    "externalMetaStore.allowedAddresses={127.0.0.1/32,redis.shared.svc.cluster.local:6379}",
)


def install_crd(cluster: Cluster, timeout: float = 60) -> Path:
    """Apply the ColocateJob CRD and wait until the API server serves it. Polled: `kubectl wait` fails at
    once, not waiting, while a CRD just created has its status conditions still null (a loaded machine)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    established = '{.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + timeout
    while True:
        got = cluster.kubectl(
            "get", "crd/colocatejobs.colocate.dev", "-o", f"jsonpath={established}", check=False
        )
        if got.stdout.strip() == "True":
            return CRD_PATH
        if time.monotonic() > deadline:
            raise AssertionError(f"the CRD not Established after {timeout} s: {got.stdout or got.stderr}")
        time.sleep(0.2)


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
