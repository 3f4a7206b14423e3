"""ColocateJob operator benchmark: apply -> all pods Running for a 4-node job; operator memory with N jobs.

Runs against the cluster in KUBECONFIG, or starts a local control plane (etcd, kube-apiserver,
controller-manager, scheduler, kwok with 4 fake GPU nodes of 8 GPUs) with --start-cluster. The operator
runs as a subprocess (`python -m colocate_operator --namespace <bench ns>`) with its default settings.

    .venv/bin/python bench/operator_bench.py --start-cluster
    KUBECONFIG=... .venv/bin/python bench/operator_bench.py --runs 5 --jobs 100

Latency is measured from the start of `kubectl apply` (the API create when no kubectl is found) until every
pod of the job is in phase Running (polled every 50 ms), and separately until the job's status.phase is
Running (which also needs the Redis meta-store ready). Memory is the operator process's resident set size,
sampled every second: idle (no jobs), and after N one-GPU jobs were created and reconciled.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import yaml

from colocate_operator import kube

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"
CRDS = kube.Kind("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
NAMESPACES = kube.Kind("v1", "namespaces", namespaced=False)


def wait(probe: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_manifest(name: str, namespace: str, num_nodes: int, gpus_per_node: int) -> dict[str, Any]:
    return {
        "apiVersion": "colocate.dev/v1alpha1",
        "kind": "ColocateJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": num_nodes,
            "gpusPerNode": gpus_per_node,
            "model": {"arch": "qwen3"},
            "trainer": {"image": "example.com/trainer:bench"},
            "rollout": {"image": "example.com/sglang:bench"},
        },
    }


@contextmanager
def cluster_from_args(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """Yields (kubeconfig, kubectl path or None)."""
    if not args.start_cluster:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise SystemExit("set KUBECONFIG or pass --start-cluster")
        yield kubeconfig, shutil.which("kubectl")
        return
    from colocate_devcluster import Cluster, ClusterSpec

    with tempfile.TemporaryDirectory(prefix="cj-bench-") as workdir:
        cluster = Cluster(ClusterSpec(workdir=Path(workdir), gpu_nodes=4, gpus_per_node=8, verbose=False))
        with cluster:
            yield str(cluster.kubeconfig), str(cluster.bin_dir / "kubectl")


class Operator:
    def __init__(self, namespace: str, kubeconfig: str, log_path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "colocate_operator",
                    "--namespace",
                    namespace,
                    "--liveness",
                    f"http://127.0.0.1:{port}/healthz",
                ],
                cwd=ROOT,
                env={**os.environ, "KUBECONFIG": kubeconfig},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.ps = psutil.Process(self.process.pid)

        def live() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited; log: {log_path}")
            with suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return True
            return False

        wait(live, 60, "operator liveness", interval=0.2)

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()


def install_crd(api: kube.Kube) -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    existing = api.get(CRDS, None, crd["metadata"]["name"])
    if existing is None:
        api.create(CRDS, None, crd)
    else:
        crd["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
        api._request("PUT", CRDS.path(None, crd["metadata"]["name"]), body=crd)

    def established() -> bool:
        body = api.get(CRDS, None, crd["metadata"]["name"]) or {}
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (body.get("status") or {}).get("conditions") or []
        )

    wait(established, 60, "CRD established", interval=0.2)


def apply(api: kube.Kube, kubectl: str | None, kubeconfig: str, manifest: dict[str, Any]) -> None:
    if kubectl:
        subprocess.run(
            [kubectl, f"--kubeconfig={kubeconfig}", "apply", "-f", "-"],
            input=json.dumps(manifest),
            text=True,
            check=True,
            capture_output=True,
        )
    else:
        api.create(kube.COLOCATE_JOBS, manifest["metadata"]["namespace"], manifest)


def measure_latency(
    api: kube.Kube, kubectl: str | None, kubeconfig: str, namespace: str, runs: int
) -> list[tuple[float, float]]:
    results = []
    for run in range(runs):
        name = f"latency-{run}"
        selector = f"colocate.dev/job={name},colocate.dev/component=worker"
        started = time.monotonic()
        apply(api, kubectl, kubeconfig, job_manifest(name, namespace, 4, 8))

        def all_running(selector: str = selector) -> bool:
            pods = api.list(kube.PODS, namespace, selector)
            return len(pods) == 4 and all((p.get("status") or {}).get("phase") == "Running" for p in pods)

        wait(all_running, 120, f"{name}: 4 pods Running")
        pods_running = time.monotonic() - started

        def phase_running(name: str = name) -> bool:
            body = api.get(kube.COLOCATE_JOBS, namespace, name) or {}
            return (body.get("status") or {}).get("phase") == "Running"

        wait(phase_running, 120, f"{name}: status.phase Running")
        results.append((pods_running, time.monotonic() - started))
        api.delete(kube.COLOCATE_JOBS, namespace, name)
        # The next run needs every GPU back: wait for the pods and their claims to be gone.
        wait(lambda selector=selector: not api.list(kube.PODS, namespace, selector), 120, "pods deleted", 0.2)
        wait(lambda: not api.list(kube.CLAIMS, namespace), 120, "claims released", 0.2)
    return results


def measure_memory(
    api: kube.Kube, operator: Operator, namespace: str, jobs: int, settle: float
) -> tuple[float, float, int, float]:
    for i in range(jobs):
        api.create(kube.COLOCATE_JOBS, namespace, job_manifest(f"mem-{i:03d}", namespace, 1, 1))
    started = time.monotonic()
    peak = 0.0

    def reconciled() -> bool:
        nonlocal peak
        peak = max(peak, operator.rss_mib())
        items = api.list(kube.COLOCATE_JOBS, namespace)
        return sum(1 for j in items if (j.get("status") or {}).get("phase")) >= jobs

    wait(reconciled, 600, f"{jobs} jobs reconciled", interval=1.0)
    reconcile_seconds = time.monotonic() - started
    end = time.monotonic() + settle
    samples = []
    while time.monotonic() < end:
        samples.append(operator.rss_mib())
        time.sleep(1)
    running = sum(
        1
        for j in api.list(kube.COLOCATE_JOBS, namespace)
        if (j.get("status") or {}).get("phase") == "Running"
    )
    return statistics.median(samples), max(peak, *samples), running, reconcile_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--start-cluster", action="store_true", help="start a local control plane for the run"
    )
    parser.add_argument(
        "--runs", type=int, default=5, help="4-node jobs to time one after another (default 5)"
    )
    parser.add_argument("--jobs", type=int, default=100, help="jobs for the memory measurement (default 100)")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to sample RSS after reconciling")
    args = parser.parse_args(argv)

    with cluster_from_args(args) as (kubeconfig, kubectl):
        os.environ["KUBECONFIG"] = kubeconfig
        api = kube.Kube.from_environment()
        install_crd(api)
        namespace = f"cj-bench-{secrets.token_hex(3)}"
        api.create(
            NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        log_path = Path(tempfile.gettempdir()) / f"{namespace}-operator.log"
        operator = Operator(namespace, kubeconfig, log_path)
        try:
            time.sleep(2)
            idle = operator.rss_mib()
            latency = measure_latency(api, kubectl, kubeconfig, namespace, args.runs)
            rss, peak, running, reconcile_seconds = measure_memory(
                api, operator, namespace, args.jobs, args.settle
            )
        finally:
            operator.stop()
            api.delete(NAMESPACES, None, namespace)

    pods = [p for p, _ in latency]
    phases = [s for _, s in latency]
    rows = [
        ("apply -> 4/4 pods Running (4 nodes x 8 GPUs, DRA), median", f"{statistics.median(pods):.2f} s"),
        ("  min / max over runs", f"{min(pods):.2f} / {max(pods):.2f} s ({len(pods)} runs)"),
        ("apply -> status.phase Running (pods + Redis ready), median", f"{statistics.median(phases):.2f} s"),
        ("operator RSS, idle", f"{idle:.1f} MiB"),
        (f"operator RSS with {args.jobs} jobs (median / peak)", f"{rss:.1f} / {peak:.1f} MiB"),
        ("  per job above idle", f"{(rss - idle) / max(args.jobs, 1) * 1024:.0f} KiB"),
        (f"  {args.jobs} jobs: all reconciled after / Running", f"{reconcile_seconds:.1f} s / {running}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'metric':{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for metric, value in rows:
        print(f"| {metric:{width}} | {value} |")
    print(f"\nhost: {os.cpu_count()} CPUs; operator log: {log_path}")
    print(
        "reproduce: .venv/bin/python bench/operator_bench.py "
        + ("--start-cluster " if args.start_cluster else "")
        + f"--runs {args.runs} --jobs {args.jobs} --settle {args.settle:g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
