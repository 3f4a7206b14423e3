"""`make demo DEMO_ARGS=--real-node` as README documents it (a work directory of its own, three steps): the
images built here, the chart's operator Deployment Ready on the real node from localhost/colocate-operator,
the job's Redis, trainer and SGLang stand-in running as containers there, every step in the job's status,
the job Succeeded, and nothing of the cluster left running."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from colocate_devcluster.realnode import can_run, node_name
from demo.realnode_demo import OPERATOR_REPOSITORY, REDIS_IMAGE, RUNTIME_IMAGE
from tests.kube import ROOT
from tests.realnode.conftest import SLOW

pytestmark = [
    pytest.mark.integration,
    # The images (rebuilt after a source change: minutes), the node's import of the 1.3 GB runtime image
    # (about a minute), the job: the slow set, like test_realnode_job.py.
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not SLOW, reason="slow set: set COLOCATE_SLOW_TESTS=1"),
]
STEPS = 3


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    why = can_run()
    if why:
        pytest.skip(f"this machine cannot run a real node: {why}")
    workdir = tmp_path_factory.mktemp("demo") / "cluster"
    args = f"--real-node --steps {STEPS} --workdir {workdir}"
    result = subprocess.run(
        ["make", "demo", f"DEMO_ARGS={args}"],
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
    )
    print(result.stdout[-6000:])
    return result, workdir


def _section(out: str, title: str) -> str:
    start = out.index(title)
    end = out.find("\n\x1b[1m== ", start)
    return out[start : end if end >= 0 else len(out)]


def test_the_demo_succeeds_with_every_step_in_status(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, _ = demo_run
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-3000:]
    assert "demo succeeded" in out
    summary = _section(out, "7/7 summary")
    rows = [line.split() for line in summary.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == [str(s) for s in range(1, STEPS + 1)], summary
    assert all(row[3] == "Succeeded" and row[-3:] == ["yes,", "every", "pod"] for row in rows), summary
    assert "phase Succeeded" in summary and "WeightSyncHealthy=True" in summary
    steps = _section(out, f"5/7 {STEPS} weight-update steps")
    last = steps.strip().splitlines()[-1].split()
    assert last[:3] == ["demo", "Succeeded", str(STEPS)], steps


def test_the_operator_runs_in_cluster_from_the_image_built_here(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    out = demo_run[0].stdout
    chart = _section(out, "3/7 helm install")
    assert "operator Deployment Ready" in chart, chart
    deploy = next(line.split() for line in chart.splitlines() if line.startswith("deployment.apps/"))
    assert deploy[1] == "1/1", chart  # its readiness probe green
    rows = _containers(out)
    operator = [r for r in rows if r[0].startswith("colocate-system/")]
    assert len(operator) == 1, rows
    assert operator[0][1] == node_name(0) and operator[0][3] == f"{OPERATOR_REPOSITORY}:0.1.0", operator
    assert operator[0][4:6] == ["running", "(containerd)"], operator


def test_the_jobs_redis_trainer_and_sglang_ran_as_containers_on_the_real_node(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    rows = {r[2]: r for r in _containers(demo_run[0].stdout) if r[0].startswith("demo/")}
    assert set(rows) == {"redis", "trainer", "rollout"}, rows
    assert {r[1] for r in rows.values()} == {node_name(0)}, rows
    assert rows["redis"][3] == REDIS_IMAGE and rows["redis"][4] == "running", rows
    assert rows["trainer"][3] == RUNTIME_IMAGE and rows["trainer"][4:6] == ["exited", "0"], rows
    assert rows["rollout"][3] == RUNTIME_IMAGE and rows["rollout"][4] == "running", rows  # SGLang serves on
    assert all(r[-1] == "0" for r in rows.values()), rows  # no restart
    assert all("(containerd)" in r for r in rows.values()), rows


def test_the_demo_leaves_nothing_running(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, workdir = demo_run
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if str(workdir) in line]
    assert not left, left


def _containers(out: str) -> list[list[str]]:
    table = _section(out, "6/7 the pods and containers")
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("pod "))
    return [line.split() for line in lines[header + 1 :] if line.strip()]
