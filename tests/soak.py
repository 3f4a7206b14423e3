"""A fault soak of the operator on the local control plane (issue 30, item 11): not part of `make test`.

    .venv/bin/python -m tests.soak --seed 1                 # 50 jobs, 10 minutes of faults
    .venv/bin/python -m tests.soak --seed 1 --minutes 2 --jobs 20

Two operator processes with --leader-elect under the chart's RBAC reconcile `--jobs` one-pod jobs on kwok
nodes while a schedule drawn from `--seed` (the same seed, the same faults in the same order) deletes worker
pods, SIGKILLs the leader (a new standby replaces it), restarts kube-apiserver, deletes Managed meta-store
pods (kwok runs no Redis process, so a restart is what can be done to it here; a paused real Redis is
covered by tests/operator/test_metastore_stall_integration.py), finishes jobs (their trainer's final
record as a termination message) and fails others (a pod deleted from a job with maxRestarts 0).

Invariants, checked every few seconds and at the end (after the faults stop and the jobs settle):
no job lost or duplicated (same names, same uids), no orphaned child (every labelled object is owned by a
live job), at most one current group of pods per job, status.restarts and weightSync.lastCompletedStep
never go backwards, a terminal phase never changes, every finished job in the right phase (Succeeded after
its final record, Failed after a failure with no restart left), every other job Running at the end, and the
operators' resident memory under `--max-rss-mib`. Prints a JSON summary; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_devcluster import Cluster, ClusterSpec
from colocate_runtime.contract.events import final_termination_message
from tests.kube import chart_identity
from tests.operator.harness import TEST_CHART_VALUES, OperatorProcess, install_crd
from tests.operator.test_integration import job_manifest

NAMESPACE = "soak"
LEASE_NAMESPACE = "colocate-system"
# Owners before what they own: a meta-store pod belongs to a ReplicaSet of the job's Deployment.
CHILD_KINDS = ("services", "networkpolicies", "secrets", "deployments", "replicasets", "pods")
TERMINAL = ("Succeeded", "Failed")


@dataclass
class World:
    """What the soak did and saw: the jobs it made, what it expects of them, and the violations."""

    uids: dict[str, str] = field(default_factory=dict)
    fragile: set[str] = field(default_factory=set)  # maxRestarts 0: a deleted pod fails them
    finished: set[str] = field(default_factory=set)  # given their final record: must end Succeeded
    failed: set[str] = field(default_factory=set)  # fragile jobs whose pod was deleted: must end Failed
    restarts: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    terminal: dict[str, str] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    max_rss_mib: float = 0.0
    takeovers: list[float] = field(default_factory=list)

    def violate(self, message: str) -> None:
        if message not in self.violations:
            print(f"[soak] VIOLATION {message}", file=sys.stderr)
            self.violations.append(message)


def kubectl_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    result = cluster.kubectl("get", "-n", NAMESPACE, *args, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    return json.loads(result.stdout)


def check(cluster: Cluster, world: World, operators: list[OperatorProcess], max_rss: float) -> bool:
    """One round of invariants; False when the API server did not answer (nothing concluded)."""
    jobs = kubectl_json(cluster, "colocatejobs")
    if not jobs:
        return False
    seen = {j["metadata"]["name"]: j for j in jobs["items"]}
    for name in world.uids.keys() - seen.keys():
        world.violate(f"job {name} lost")
    for name in seen.keys() - world.uids.keys():
        world.violate(f"job {name} appeared")
    uids = {}
    for name, job in seen.items():
        uids[job["metadata"]["uid"]] = name
        if world.uids.get(name) not in (None, job["metadata"]["uid"]):
            world.violate(f"job {name} re-created (uid changed)")
        status = job.get("status") or {}
        _monotonic(world, name, "restarts", world.restarts, int(status.get("restarts") or 0))
        step = int((status.get("weightSync") or {}).get("lastCompletedStep") or 0)
        _monotonic(world, name, "lastCompletedStep", world.steps, step)
        phase = status.get("phase")
        if name in world.terminal and phase != world.terminal[name]:
            world.violate(f"job {name} left terminal phase {world.terminal[name]} for {phase}")
        if phase in TERMINAL:
            world.terminal.setdefault(name, phase)
            expected = "Succeeded" if name in world.finished else "Failed" if name in world.failed else None
            if expected != phase:
                world.violate(f"job {name} ended {phase}, expected {expected or 'to keep running'}")
    live = set(uids)  # the jobs, then every object owned (through its owners) by one
    for kind in CHILD_KINDS:
        listed = kubectl_json(cluster, kind, "-l", "colocate.dev/job")
        current: Counter[str] = Counter()
        for item in listed.get("items", []):
            meta = item["metadata"]
            owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
            if not owners & live:
                world.violate(f"orphaned {kind[:-1]} {meta['name']}")
            else:
                live.add(meta["uid"])
            job = seen.get(meta["labels"].get("colocate.dev/job", ""))
            if kind == "pods" and job is not None and not meta.get("deletionTimestamp"):
                group = str((job.get("status") or {}).get("restarts") or 0)
                component = meta["labels"].get("colocate.dev/component")
                if component == "worker" and meta["labels"].get("colocate.dev/restart") == group:
                    current[job["metadata"]["name"]] += 1
        for name, count in current.items():
            if count > 1:
                world.violate(f"job {name}: {count} pods of its current group (one node)")
    for operator in operators:
        rss = _rss_mib(operator)
        world.max_rss_mib = max(world.max_rss_mib, rss)
        if rss > max_rss:
            world.violate(
                f"operator pid {operator.process.pid if operator.process else '?'} at {rss:.0f} MiB"
            )
    return True


def _monotonic(world: World, name: str, what: str, last: dict[str, int], value: int) -> None:
    if value < last.get(name, 0):
        world.violate(f"job {name}: {what} went back from {last[name]} to {value}")
    last[name] = max(value, last.get(name, 0))


def _rss_mib(operator: OperatorProcess) -> float:
    if operator.process is None or operator.process.poll() is not None:
        return 0.0
    try:
        for line in Path(f"/proc/{operator.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def leader_of(cluster: Cluster, lease: str, operators: list[OperatorProcess]) -> OperatorProcess | None:
    found = cluster.kubectl("get", "lease", lease, "-n", LEASE_NAMESPACE, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    holder = json.loads(found.stdout)["spec"].get("holderIdentity") or ""
    alive = [o for o in operators if o.process and o.process.poll() is None]
    return next((o for o in alive if o.process and holder.endswith(f"-{o.process.pid}")), None)


class Faults:
    def __init__(self, cluster: Cluster, world: World, rng: random.Random, start_operator) -> None:
        self.cluster, self.world, self.rng, self.start_operator = cluster, world, rng, start_operator

    def pick(self) -> str:
        kinds = (
            ["delete-pod"] * 4 + ["finish-job"] * 2 + ["restart-metastore"] * 2 + ["kill-leader", "apiserver"]
        )
        return self.rng.choice(kinds)

    def live_jobs(self) -> list[str]:
        return sorted(n for n in self.world.uids if n not in self.world.finished | self.world.failed)

    def run(self, kind: str, operators: list[OperatorProcess], lease: str) -> None:
        jobs = self.live_jobs()
        target = self.rng.choice(jobs) if jobs else None
        if kind == "delete-pod" and target:
            if target in self.world.fragile:
                self.world.failed.add(target)
            self.cluster.kubectl("delete", "pod", f"{target}-0", "-n", NAMESPACE, "--wait=false", check=False)
        elif kind == "finish-job" and target and target not in self.world.fragile:
            if self._finish(target):
                self.world.finished.add(target)
            else:
                return
        elif kind == "restart-metastore" and target:
            selector = f"colocate.dev/job={target},colocate.dev/component=metastore"
            self.cluster.kubectl(
                "delete", "pods", "-l", selector, "-n", NAMESPACE, "--wait=false", check=False
            )
        elif kind == "kill-leader":
            leader = leader_of(self.cluster, lease, operators)
            if leader is None:
                return
            leader.kill()
            killed = time.monotonic()
            operators.remove(leader)
            if _wait(lambda: leader_of(self.cluster, lease, operators), 30, interval=0.2) is None:
                self.world.violate("no leader 30 s after the leader was killed")
            else:
                self.world.takeovers.append(round(time.monotonic() - killed, 1))
            # A new standby, as the Deployment's restarted pod would be.
            operators.append(self.start_operator(sum(self.world.faults.values()) + 2))
        elif kind == "apiserver":
            self.cluster.restart("kube-apiserver", down_seconds=3)
        else:
            return
        self.world.faults[kind] += 1

    def _finish(self, job: str) -> bool:
        """The trainer recorded its final step and both containers exited 0 (what a kubelet reports)."""
        pods = kubectl_json(
            self.cluster, "pods", "-l", f"colocate.dev/job={job},colocate.dev/component=worker"
        )
        running = [p for p in pods.get("items", []) if p["status"].get("phase") == "Running"]
        if not running:
            return False
        done = {"terminated": {"exitCode": 0, "reason": "Completed", "message": final_termination_message(5)}}
        statuses = [
            {"name": c, "state": done, "ready": False, "restartCount": 0, "image": c, "imageID": ""}
            for c in ("trainer", "rollout")
        ]
        patch = json.dumps({"status": {"phase": "Succeeded", "containerStatuses": statuses}})
        for pod in running:
            name = pod["metadata"]["name"]
            result = self.cluster.kubectl(
                "patch",
                "pod",
                name,
                "-n",
                NAMESPACE,
                "--subresource=status",
                "--type=merge",
                "-p",
                patch,
                check=False,
            )
            if result.returncode != 0:
                return False
        return True


def supervise(cluster, world: World, operators: list[OperatorProcess], lease: str, start_operator, since):
    """What the Deployment's kubelet does: an operator that exited (a leader past its renew deadline while
    the apiserver was down exits on purpose) is started again, as a standby. And someone must lead: no
    leader for 35 s (a lease runs 15 s) is a violation. Returns since when there has been no leader."""
    for operator in list(operators):
        if operator.process is not None and operator.process.poll() is not None:
            operators.remove(operator)
            world.faults["operator-exited"] += 1
            operators.append(start_operator(sum(world.faults.values()) + 2))
    if leader_of(cluster, lease, operators) is not None:
        return None
    now = time.monotonic()
    if since is not None and now - since > 35:
        world.violate(f"no operator led for {now - since:.0f} s")
    return since if since is not None else now


def _wait(probe, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(interval)
    return None


def make_jobs(cluster: Cluster, world: World, count: int, rng: random.Random) -> None:
    manifests = []
    for i in range(count):
        name = f"soak-{i:03d}"
        fragile = rng.random() < 0.2
        if fragile:
            world.fragile.add(name)
        manifests.append(
            job_manifest(
                name,
                NAMESPACE,
                numNodes=1,
                gpusPerNode=1,
                gpu={"allocation": "DevicePlugin"},
                runPolicy={"maxRestarts": 0 if fragile else 1000, "backoffSeconds": 1},
            )
        )
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
    )
    items = kubectl_json(cluster, "colocatejobs")["items"]
    world.uids = {j["metadata"]["name"]: j["metadata"]["uid"] for j in items}


def pod_states(cluster: Cluster, job: str) -> list[str]:
    """What a stuck job's worker pods show: name, phase, node (none: never scheduled), scheduling reason."""
    listed = kubectl_json(cluster, "pods", "-l", f"colocate.dev/job={job},colocate.dev/component=worker")
    states = []
    for pod in listed.get("items", []):
        status = pod.get("status") or {}
        reasons = [c.get("reason") for c in status.get("conditions") or [] if c.get("status") == "False"]
        node = (pod.get("spec") or {}).get("nodeName") or "unscheduled"
        states.append(f"{pod['metadata']['name']} {status.get('phase')} on {node} {reasons or ''}".strip())
    return states


def settle(cluster: Cluster, world: World, timeout: float) -> dict[str, str]:
    """Wait for every job to reach the phase it should end in; returns the jobs that did not."""

    def pending() -> dict[str, str]:
        jobs = {j["metadata"]["name"]: j for j in kubectl_json(cluster, "colocatejobs").get("items", [])}
        wrong = {}
        for name in world.uids:
            phase = ((jobs.get(name) or {}).get("status") or {}).get("phase", "?")
            want = "Succeeded" if name in world.finished else "Failed" if name in world.failed else "Running"
            if phase != want:
                wrong[name] = f"{phase} (want {want})"
        return wrong

    deadline = time.monotonic() + timeout
    wrong = pending()
    while wrong and time.monotonic() < deadline:
        time.sleep(3)
        wrong = pending()
    return wrong


def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    world = World()
    workdir = Path(tempfile.mkdtemp(prefix="colocate-soak-"))
    cluster = Cluster(ClusterSpec(workdir=workdir / "cluster", gpu_nodes=args.nodes, gpus_per_node=8))
    cluster.start()
    operators: list[OperatorProcess] = []
    try:
        install_crd(cluster)
        cluster.kubectl("create", "namespace", NAMESPACE)
        identity = chart_identity(
            cluster, NAMESPACE, workdir, *TEST_CHART_VALUES, operator_namespace=LEASE_NAMESPACE
        )
        lease = "colocate-soak"
        election = (
            "--leader-elect",
            "--leader-elect-namespace",
            LEASE_NAMESPACE,
            "--leader-elect-lease",
            lease,
        )

        numbers = itertools.count()

        def start_operator(_: int) -> OperatorProcess:
            log = workdir / f"operator-{next(numbers)}.log"
            # The chart's resync interval, not the tests' 2 s: 50 jobs on 2 shared cores.
            env = {"COLOCATE_RECONCILE_INTERVAL_SECONDS": "30"}
            return OperatorProcess(NAMESPACE, log, identity, election, **env).start(timeout=120)

        operators += [start_operator(0), start_operator(1)]
        make_jobs(cluster, world, args.jobs, rng)
        started = time.monotonic()
        if settle(cluster, world, 180):
            world.violate("the jobs did not all reach Running before the faults began")
        print(f"[soak] {args.jobs} jobs Running after {time.monotonic() - started:.0f} s", file=sys.stderr)
        faults = Faults(cluster, world, rng, start_operator)
        end = time.monotonic() + args.minutes * 60
        next_check = 0.0
        leaderless: float | None = None
        while time.monotonic() < end:
            kind = faults.pick()
            faults.run(kind, operators, lease)
            pause = rng.uniform(0.5, 2.0) * args.fault_interval
            until = time.monotonic() + pause
            while time.monotonic() < until:
                if time.monotonic() >= next_check:
                    check(cluster, world, operators, args.max_rss_mib)
                    leaderless = supervise(cluster, world, operators, lease, start_operator, leaderless)
                    next_check = time.monotonic() + args.check_interval
                time.sleep(0.5)
        wrong = settle(cluster, world, args.settle_seconds)
        for name, phase in sorted(wrong.items()):
            world.violate(
                f"job {name} is {phase} after the faults stopped; its pods: {pod_states(cluster, name)}"
            )
        if not check(cluster, world, operators, args.max_rss_mib):
            world.violate("the API server did not answer the final check")
        return {
            "seed": args.seed,
            "jobs": args.jobs,
            "minutes": args.minutes,
            "faults": dict(world.faults),
            "finished": len(world.finished),
            "failed": len(world.failed),
            "takeoverSeconds": world.takeovers,
            "maxOperatorRssMiB": round(world.max_rss_mib, 1),
            # kube-scheduler exits on purpose on a corrupted cache; devcluster restarts it as a kubelet would
            "controlPlaneRestarts": cluster.supervisor.restarts if cluster.supervisor else {},
            "violations": world.violations,
            "logs": str(workdir),
        }
    finally:
        for operator in operators:
            operator.stop()
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--nodes", type=int, default=8, help="kwok GPU nodes of 8 GPUs (default: %(default)s)"
    )
    parser.add_argument("--fault-interval", type=float, default=8.0, help="mean seconds between faults")
    parser.add_argument("--check-interval", type=float, default=5.0)
    parser.add_argument("--settle-seconds", type=float, default=180.0)
    parser.add_argument("--max-rss-mib", type=float, default=400.0)
    summary = soak(parser.parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
