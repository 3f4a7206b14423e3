"""What one ColocateJob status write costs the API server (issue 35): N jobs on a fresh control plane (no
nodes, no operator), each given the status our operator writes (the reconciler's part, then the step
follower's merge patch, built by the operator's own `step_patch`), then R rounds in which 16 threads patch
every job's status once, as the operator's 16 writers do. A round of ConfigMap merge patches is the
baseline of a built-in type. Two watches of the jobs stand in for the operator's and the bench tracker's.

    python -m bench.scale.status_write_bench --jobs 300 --rounds 3

prints one JSON line (and appends it to bench/results/status_writes.jsonl): per round the writes a second
and kube-apiserver's and etcd's CPU milliseconds a write, and the stored job's size. At 1000 jobs a step
status that must catch up within 10 s needs 100 such writes a second from what the API server has left.

`--rules` measures the CRD with some of its CEL rules taken out (what they cost a status write, which
validates the whole object): `transition` (the spec's three rules reading oldSelf), `spec` (all of spec's
own cross-field rules), `none` (every rule in the schema). An exploration: the operator ships `all`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.scale.operators import usage
from bench.scale.source import OperatorSource, snapshot
from bench.scale.testbed import ROOT, Testbed
from bench.scale.workloads import COLOCATE, colocate_job, job_name, stored_sizes
from colocate_operator.status import StepRecordStatus, WeightSyncStatus, step_patch

NAMESPACE = "status-bench"
THREADS = 16  # the operator's WRITES_IN_FLIGHT
RESULTS = ROOT / "bench" / "results" / "status_writes.jsonl"


RULES = ("all", "transition", "spec", "none")


def _strip_rules(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("x-kubernetes-validations", None)
        for value in node.values():
            _strip_rules(value)
    elif isinstance(node, list):
        for value in node:
            _strip_rules(value)


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The schema of the (only) version's `spec`, where the cross-field rules live."""
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def crd_without(crd: dict[str, Any], rules: str) -> dict[str, Any]:
    """`crd` (a parsed copy, changed in place) without the CEL rules `rules` names (see the module's doc)."""
    spec = spec_schema(crd)
    own = spec.get("x-kubernetes-validations", [])
    if rules == "transition":
        spec["x-kubernetes-validations"] = [rule for rule in own if "oldSelf" not in rule["rule"]]
    elif rules == "spec":
        spec.pop("x-kubernetes-validations", None)
    elif rules == "none":
        _strip_rules(crd)
    elif rules != "all":
        raise ValueError(f"--rules must be one of {RULES}, not {rules!r}")
    return crd


def reconciler_status() -> dict[str, Any]:
    """The reconciler's part of a running job's status, as the scale bench's jobs show it."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    owned = [
        ("MetaStoreReady", "True", "ExternalConfigured", "external Redis at 127.0.0.1:6379"),
        (
            "ResourcesAllocated",
            "True",
            "DevicePluginFallback",
            "4/4 pods scheduled; GPUs from the device plugin",
        ),
        ("PodsReady", "True", "AllPodsReady", "4/4 pods ready"),
        ("Suspended", "False", "NotSuspended", ""),
    ]
    return {
        "phase": "Running",
        "observedGeneration": 1,
        "ready": "4/4",
        "restarts": 0,
        "groupCreated": True,
        "startTime": now,
        "replicas": {"desired": 4, "created": 4, "scheduled": 4, "running": 4, "ready": 4, "failed": 0},
        "metaStore": {"mode": "External", "address": "127.0.0.1:6379", "secretName": "bench-redis"},
        "conditions": [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastTransitionTime": now,
                "observedGeneration": 1,
            }
            for t, s, r, m in owned
        ],
    }


def step_status(step: int, base: dict[str, Any]) -> dict[str, Any]:
    """The step follower's merge patch after `step` (the operator's own `step_patch`): weightSync, the last
    10 steps, and every condition (a merge patch replaces the list)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    recent = tuple(
        StepRecordStatus(
            step=s,
            result="Succeeded",
            sync_seconds=0.5,
            bytes=32 << 30,
            weight_version=str(s),
            completion_time=now,
        )
        for s in range(max(1, step - 9), step + 1)
    )
    sync = WeightSyncStatus(
        current_phase="Rollout",
        last_completed_step=step,
        weight_version=str(step),
        last_sync_seconds=0.5,
        last_sync_bytes=32 << 30,
    )
    conditions = [
        *base["conditions"],
        {
            "type": "WeightSyncHealthy",
            "status": "True",
            "reason": "StepSucceeded",
            "message": f"step {step} synced",
            "lastTransitionTime": now,
            "observedGeneration": 1,
        },
        {
            "type": "Progressing",
            "status": "True",
            "reason": "StepCompleted",
            "message": f"step {step} completed",
            "lastTransitionTime": now,
            "observedGeneration": 1,
        },
    ]
    return {"status": step_patch(sync, recent, conditions)}


def timed_round(
    bed: Testbed, paths: list[str], patch: Callable[[int], dict[str, Any]], round_: int
) -> dict[str, float]:
    """Every path patched once by THREADS threads: writes a second; API server and etcd CPU ms a write."""
    api_pid, etcd_pid = bed.pid_of("kube-apiserver"), bed.pid_of("etcd")
    assert api_pid and etcd_pid
    api0, etcd0, started = usage(api_pid).cpu_seconds, usage(etcd_pid).cpu_seconds, time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda path: bed.api.merge_patch(path, patch(round_)), paths))
    wall, n = time.monotonic() - started, len(paths)
    return {
        "writes_per_s": round(n / wall, 1),
        "apiserver_ms": round(1000 * (usage(api_pid).cpu_seconds - api0) / n, 2),
        "etcd_ms": round(1000 * (usage(etcd_pid).cpu_seconds - etcd0) / n, 2),
    }


def measure(bed: Testbed, jobs: int, rounds: int) -> dict[str, Any]:
    bed.create_namespace(NAMESPACE)
    names = [job_name(i) for i in range(jobs)]
    base = COLOCATE.path(NAMESPACE)
    maps = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda n: bed.api.create(base, colocate_job(NAMESPACE, n)), names))
        list(pool.map(lambda n: bed.api.create(maps, {"metadata": {"name": n}, "data": {"v": "0"}}), names))
        list(
            pool.map(
                lambda n: bed.api.merge_patch(f"{base}/{n}/status", {"status": reconciler_status()}), names
            )
        )
    stop = threading.Event()
    for _ in range(2):  # the operator's watch and the bench tracker's
        threading.Thread(target=lambda: [None for _ in bed.api.watch(base, stop)], daemon=True).start()
    time.sleep(2)
    owned = reconciler_status()
    status_paths = [f"{base}/{n}/status" for n in names]
    result: dict[str, Any] = {"jobs": jobs, "threads": THREADS, "configmap": [], "status": []}
    for r in range(1, rounds + 1):
        result["configmap"].append(
            timed_round(bed, [f"{maps}/{n}" for n in names], lambda i: {"data": {"v": str(i)}}, r)
        )
        result["status"].append(timed_round(bed, status_paths, lambda i: step_status(i, owned), r))
    stored = stored_sizes(bed.api.get(f"{base}/{names[0]}"))
    result["job_bytes"], result["managed_fields_bytes"] = stored["whole"], stored["managed_fields"]
    stop.set()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rules", choices=RULES, default="all", help="the CRD's CEL rules kept (see above)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON line is appended here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="status-bench-") as work:
        shipped = snapshot("worktree", Path(work)).crd
        crd = Path(work) / "crd.yaml"
        crd.write_text(yaml.safe_dump(crd_without(yaml.safe_load(shipped.read_text()), args.rules)))
        bed = Testbed(
            Path(work) / "bed", gpu_nodes=0, cpu_nodes=0, source=OperatorSource("", "", crd)
        ).start()
        try:
            result = measure(bed, args.jobs, args.rounds)
        finally:
            bed.stop()
    result.update(
        rules=args.rules, time=datetime.now(UTC).isoformat(timespec="seconds"), load=os.getloadavg()[0]
    )
    line = json.dumps(result)
    print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(line + "\n")


if __name__ == "__main__":
    main()
