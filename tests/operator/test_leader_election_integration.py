"""Issue 30 item 10 on the real control plane: two operator processes under the chart's RBAC with
--leader-elect. Only the Lease holder writes; killed (SIGKILL) while it creates the job's pods, the standby
takes the Lease over within 15 s and brings the job to Running with exactly one set of children and no
Event posted twice."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.kube import ChartIdentity, forbidden_lines, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, events, get, pods, wait_phase

pytestmark = pytest.mark.integration

LEASE_NAMESPACE = "colocate-system"  # the chart's release namespace in these tests: its Role is there


def holder(cluster, lease: str) -> str:
    found = cluster.kubectl("get", "lease", lease, "-n", LEASE_NAMESPACE, "-o", "json", check=False)
    if found.returncode != 0:
        return ""
    return json.loads(found.stdout)["spec"].get("holderIdentity") or ""


def holds(process: OperatorProcess, identity: str) -> bool:
    return process.process is not None and identity.endswith(f"-{process.process.pid}")


def writes(process: OperatorProcess) -> list[str]:
    """The operator's log lines that say it wrote to the job or its children."""
    marks = ('"message": "created"', '"message": "status updated"', '"message": "deleted pod"')
    return [line for line in process.log().splitlines() if any(m in line for m in marks)]


def taken_over_at(process: OperatorProcess) -> datetime:
    for line in process.log().splitlines():
        if '"message": "lease taken over"' in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"])
    raise AssertionError("no 'lease taken over' in the standby's log")


def children(cluster, namespace: str) -> dict[str, list[str]]:
    found = {}
    for kind in ("deployments", "services", "networkpolicies", "secrets"):
        items = get(cluster, namespace, kind, "-l", "colocate.dev/job=demo")["items"]
        found[kind] = sorted(i["metadata"]["name"] for i in items)
    return found


def test_the_standby_takes_over_a_killed_leader_mid_reconcile_without_duplicates(
    cluster, namespace: str, operator_identity: ChartIdentity, tmp_path: Path
) -> None:
    lease = f"colocate-{namespace}"
    args = ("--leader-elect", "--leader-elect-namespace", LEASE_NAMESPACE, "--leader-elect-lease", lease)
    # One pod a second (fault injection): the leader is killed while it creates them.
    env = {"COLOCATE_CREATE_DELAY_SECONDS": "1"}
    both = [OperatorProcess(namespace, tmp_path / f"{n}.log", operator_identity, args, **env) for n in "ab"]
    began = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:  # both at once: one wins the Lease
            list(pool.map(lambda p: p.start(), both))
        owner = wait_for(lambda: holder(cluster, lease), 15, "an operator holding the Lease")
        a, b = both if holds(both[0], owner) else both[::-1]  # a leads, b stands by
        assert holds(a, owner)

        print(f"both started, one leads: {time.monotonic() - began:.1f} s", file=sys.stderr)
        apply_job(cluster, namespace, numNodes=3, gpusPerNode=1)
        wait_for(lambda: 1 <= len(pods(cluster, namespace)) < 3, 30, "the leader creating the pods")
        assert not writes(b), "the standby wrote:\n" + "\n".join(writes(b))
        a.kill()
        killed, killed_at = time.monotonic(), datetime.now(UTC)
        print(f"killed the leader: {killed - began:.1f} s", file=sys.stderr)

        wait_for(lambda: holds(b, holder(cluster, lease)), 20, "the standby taking the Lease over")
        takeover = (taken_over_at(b) - killed_at).total_seconds()  # b's own clock: no polling delay
        print(f"takeover {takeover:.1f} s after SIGKILL", file=sys.stderr)
        assert takeover <= 15.5, f"the standby took {takeover:.1f} s"

        wait_phase(cluster, namespace, "Running", timeout=40)
        print(f"Running {time.monotonic() - killed:.1f} s after SIGKILL", file=sys.stderr)
        worker_pods = pods(cluster, namespace)
        assert [p["metadata"]["name"] for p in worker_pods] == ["demo-0", "demo-1", "demo-2"]
        assert {p["metadata"]["labels"]["colocate.dev/restart"] for p in worker_pods} == {"0"}
        assert children(cluster, namespace) == {
            "deployments": ["demo-metastore"],
            "services": ["demo", "demo-metastore"],
            "networkpolicies": ["demo-metastore", "demo-workers"],
            "secrets": ["demo-metastore-auth"],
        }
        posted = [e for e in events(cluster, namespace) if e["involvedObject"]["kind"] == "ColocateJob"]
        twice = [k for k, n in Counter((e["reason"], e["message"]) for e in posted).items() if n > 1]
        assert not twice, f"Events posted twice: {twice}"
        assert all(e.get("count", 1) == 1 for e in posted), [(e["reason"], e.get("count")) for e in posted]
        reasons = Counter(e["reason"] for e in posted)
        # The killed leader posts its pass's Events after the pass's writes: it announced nothing; the
        # meta-store it created is not announced again (no create of it succeeds after it).
        assert reasons["JobRunning"] == 1 and reasons["CreatedPods"] == 1, reasons
        refused = forbidden_lines(a.log()) + forbidden_lines(b.log())
        assert not refused, "the chart's RBAC refused the operator:\n" + "\n".join(refused[:10])
    finally:
        for process in both:
            process.stop()
            print(f"\n[{process.log_path.name}]\n{process.log()[-2500:]}", file=sys.stderr)
