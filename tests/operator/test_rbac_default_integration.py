"""The chart's default RBAC is namespaced (issue 30, item 9): installed with no namespace listed, the operator
manages the release's own namespace through a Role there, holds no cluster-wide write, and reconciles a job in
that namespace to Running under exactly those rights (a 403 fails the test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from tests.kube import chart_identity, forbidden_lines, render_chart
from tests.operator.harness import TEST_CHART_VALUES, OperatorProcess
from tests.operator.test_integration import apply_job, wait_phase

pytestmark = pytest.mark.integration

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


def test_the_default_chart_rbac_reconciles_a_job_in_the_release_namespace(
    cluster: Cluster, crd: Path, namespace: str, tmp_path: Path
) -> None:
    release = f"rbac-{namespace}"
    # The chart's defaults (watchNamespaces empty, rbac.clusterWide false), installed in the job's namespace.
    defaults = (*TEST_CHART_VALUES, "--set-json", "watchNamespaces=[]")
    docs = render_chart(cluster, *defaults, namespace=namespace, release=release)
    cluster_wide = [d for d in docs if d["kind"] == "ClusterRole"]
    assert (
        not {verb for role in cluster_wide for rule in role["rules"] for verb in rule["verbs"]} & WRITE_VERBS
    )
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={namespace}"]
    identity = chart_identity(
        cluster, namespace, tmp_path, *defaults, operator_namespace=namespace, release=release
    )
    process = OperatorProcess(namespace, tmp_path / "operator.log", identity).start()
    try:
        apply_job(cluster, namespace)
        wait_phase(cluster, namespace, "Running", timeout=60)
        for elsewhere in ("default", "kube-system"):
            can = cluster.kubectl(
                f"--kubeconfig={identity.kubeconfig}", "auth", "can-i", "create", "pods", "-n", elsewhere,
                check=False,
            )  # fmt: skip
            assert can.stdout.strip() == "no", f"a write in {elsewhere}, outside the release's namespace"
    finally:
        process.stop()
        print(f"\n[operator log]\n{process.log()[-3000:]}", file=sys.stderr)
        for doc in cluster_wide:
            cluster.kubectl("delete", "clusterrole", doc["metadata"]["name"], "--wait=false", check=False)
            cluster.kubectl(
                "delete", "clusterrolebinding", doc["metadata"]["name"], "--wait=false", check=False
            )
    refused = forbidden_lines(process.log())
    assert not refused, "the chart's default RBAC refused the operator:\n" + "\n".join(refused[:10])
