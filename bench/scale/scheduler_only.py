"""kube-scheduler alone (issue 35): how long it takes to place J jobs' four 8-GPU pods on N kwok 8-GPU nodes,
all created at once, by how each pod keeps its job's pods on separate nodes. No operator runs: the harness
creates each job's headless Service (as our operator makes it: selecting pod 0, which gets the scheduler's
default spreading) and its pods, shaped as our operator's (two containers, the trainer's 8 GPUs, the GPU
toleration), and a watch records when each pod is bound.

    python -m bench.scale.scheduler_only --jobs 1000 --nodes 4000 --variants anti-affinity none spread

Variants: `anti-affinity` (required podAntiAffinity on kubernetes.io/hostname, what pods.py wrote until
issue 35), `none` (no term: the GPU request alone keeps one pod a node when it fills the node), `spread`
(a topologySpreadConstraint, maxSkew 1 on the hostname, DoNotSchedule). Every variant runs on the same fresh
control plane, each in its own namespace, the pods of the one before force-deleted first. Prints a JSON
line per run: seconds until every pod was bound (from the first create), kube-scheduler CPU seconds in that
time, pods bound a second over each quarter, and pairs of a job's pods that share a node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.scale.kubeapi import ApiError
from bench.scale.testbed import Testbed
from bench.scale.workloads import GPU, GPU_TOLERATION, HALF

JOB_LABEL, COMPONENT_LABEL = "colocate.dev/job", "colocate.dev/component"
PODS_PER_JOB = 4
VARIANTS = ("anti-affinity", "none", "spread")


def placement(variant: str, job: str) -> dict[str, Any]:
    """The pod spec fields that keep a job's pods apart, for `variant`."""
    selector = {"matchLabels": {JOB_LABEL: job, COMPONENT_LABEL: "worker"}}
    if variant == "anti-affinity":
        term = {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}
        return {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}}
    if variant == "spread":
        constraint = {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": selector,
        }
        return {"topologySpreadConstraints": [constraint]}
    return {}


def pod(namespace: str, job: str, index: int, variant: str) -> dict[str, Any]:
    half = {"requests": dict(HALF), "limits": {"memory": HALF["memory"]}}
    trainer = {"requests": {**HALF, GPU: "8"}, "limits": {"memory": HALF["memory"], GPU: "8"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{index}",
            "namespace": namespace,
            "labels": {JOB_LABEL: job, COMPONENT_LABEL: "worker", "colocate.dev/replica-index": str(index)},
        },
        "spec": {
            "hostname": f"{job}-{index}",
            "subdomain": job,
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "tolerations": [dict(GPU_TOLERATION)],
            "containers": [
                {"name": "trainer", "image": "colocate/trainer:bench", "resources": trainer},
                {"name": "rollout", "image": "colocate/rollout:bench", "resources": half},
            ],
            **placement(variant, job),
        },
    }


def service(namespace: str, job: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job, "namespace": namespace},
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: job, COMPONENT_LABEL: "worker", "colocate.dev/replica-index": "0"},
            "ports": [{"name": "x", "port": 1}],
        },
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scheduler_metrics(bed: Testbed, pid: int) -> dict[str, float]:
    """kube-scheduler's cumulative seconds and counts per extension point (its /metrics, the admin token)."""
    args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    port = next(a.split("=", 1)[1] for a in args if a.startswith("--secure-port="))
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {bed.api.token}"}
    )
    context = ssl._create_unverified_context()  # its self-signed serving certificate, on loopback
    text = urllib.request.urlopen(request, context=context, timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if (
            line.startswith("scheduler_framework_extension_point_duration_seconds_")
            and 'status="Success"' in line
        ):
            kind = "sum" if "_sum{" in line else "count" if "_count{" in line else None
            if kind:
                point = line.split('extension_point="', 1)[1].split('"', 1)[0]
                out[f"{point}_{kind}"] = out.get(f"{point}_{kind}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def per_pod_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per scheduling cycle of each extension point between two snapshots."""
    points = {k.rsplit("_", 1)[0] for k in after}
    result = {}
    for point in sorted(points):
        count = after.get(f"{point}_count", 0.0) - before.get(f"{point}_count", 0.0)
        if count > 0:
            result[point] = round(1e3 * (after[f"{point}_sum"] - before.get(f"{point}_sum", 0.0)) / count, 2)
    return result


def run_variant(bed: Testbed, variant: str, jobs: int, label: str, timeout: float) -> dict[str, Any]:
    namespace = f"sched-{label}"
    bed.create_namespace(namespace)
    names = [f"job-{i:04d}" for i in range(jobs)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(
            pool.map(
                lambda j: bed.api.create(f"/api/v1/namespaces/{namespace}/services", service(namespace, j)),
                names,
            )
        )
    bound: dict[str, tuple[float, str]] = {}
    stop, done = threading.Event(), threading.Event()
    total = jobs * PODS_PER_JOB

    def watch() -> None:
        for at, event in bed.api.watch(f"/api/v1/namespaces/{namespace}/pods", stop):
            obj = event.get("object") or {}
            node = (obj.get("spec") or {}).get("nodeName")
            name = (obj.get("metadata") or {}).get("name")
            if node and name not in bound:
                bound[name] = (at, node)
                if len(bound) >= total:
                    done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    scheduler = bed.pid_of("kube-scheduler")
    assert scheduler is not None
    metrics0 = scheduler_metrics(bed, scheduler)
    cpu0, started = cpu_seconds(scheduler), time.time()
    bodies = [pod(namespace, j, i, variant) for j in names for i in range(PODS_PER_JOB)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda b: bed.api.create(f"/api/v1/namespaces/{namespace}/pods", b), bodies))
    created = time.time() - started
    finished = done.wait(timeout)
    elapsed, cpu = time.time() - started, cpu_seconds(scheduler) - cpu0
    cycle_ms = per_pod_ms(metrics0, scheduler_metrics(bed, scheduler))
    stop.set()
    times = sorted(at - started for at, _ in bound.values())
    quarters = [times[min(len(times) - 1, (len(times) * q) // 4)] for q in range(1, 5)] if times else []
    rates = [
        round((total // 4) / (b - a), 1) if b > a else None
        for a, b in zip([0.0, *quarters], quarters, strict=False)
    ]
    per_node: dict[tuple[str, str], int] = {}
    for name, (_, node) in bound.items():
        key = (name.rsplit("-", 1)[0], node)
        per_node[key] = per_node.get(key, 0) + 1
    shared = sum(n - 1 for n in per_node.values() if n > 1)
    result = {
        "variant": variant,
        "label": label,
        "pods": total,
        "bound": len(bound),
        "all_bound": finished,
        "created_s": round(created, 1),
        "all_bound_s": round(times[-1], 1) if finished and times else None,
        "quarters_s": [round(t, 1) for t in quarters],
        "bound_per_s_by_quarter": rates,
        "scheduler_cpu_s": round(cpu, 1),
        "elapsed_s": round(elapsed, 1),
        "pods_sharing_a_node_with_their_job": shared,
        "ms_per_pod_by_extension_point": cycle_ms,
        "load": round(os.getloadavg()[0], 2),
    }
    return result


def clear(bed: Testbed, label: str) -> None:
    """Force-delete the run's pods (one delete-collection a few times: each may stop at the API server's
    60-s request timeout) until none is left."""
    deadline = time.monotonic() + 600
    while not bed.drained(timeout=5) and time.monotonic() < deadline:
        with contextlib.suppress(ApiError, OSError):
            bed.api.delete(f"/api/v1/namespaces/sched-{label}/pods", gracePeriodSeconds="0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=4000)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, help="append the JSON lines here too")
    args = parser.parse_args(argv)
    bin_dir = os.environ.get("COLOCATE_BIN_DIR")
    with tempfile.TemporaryDirectory(prefix="sched-only-") as work:
        bed = Testbed(
            Path(work), gpu_nodes=args.nodes, cpu_nodes=1, bin_dir=Path(bin_dir) if bin_dir else None
        )
        bed.start()
        try:
            for r in range(args.rounds):
                for variant in args.variants:
                    result = run_variant(bed, variant, args.jobs, f"{variant}-{r}", args.timeout)
                    line = json.dumps(result)
                    print(line, flush=True)
                    if args.out is not None:
                        with args.out.open("a") as out:
                            out.write(line + "\n")
                    clear(bed, f"{variant}-{r}")
        finally:
            bed.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
