"""The operator under the Helm chart's own ServiceAccount and RBAC on the real apiserver (with
OwnerReferencesPermissionEnforcement on): who it is, what it may not do, and the verbs only a finished job
needs (ttlSecondsAfterFinished deletes the job)."""

from __future__ import annotations

import json

import pytest

from colocate_devcluster import Cluster
from tests.kube import ChartIdentity, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, fail_pod, job_event_reasons, running_pods, wait_phase

pytestmark = pytest.mark.integration


def as_operator(cluster: Cluster, identity: ChartIdentity, *args: str) -> str:
    result = cluster.kubectl(f"--kubeconfig={identity.kubeconfig}", *args, check=False)
    return (result.stdout + result.stderr).strip()


def test_operator_credentials_are_the_charts_service_account_and_no_more(
    cluster: Cluster, namespace: str, operator_identity: ChartIdentity
) -> None:
    review = json.loads(as_operator(cluster, operator_identity, "auth", "whoami", "-o", "json"))
    assert review["status"]["userInfo"]["username"] == operator_identity.service_account
    allowed = {
        "delete colocatejobs.colocate.dev",
        "update colocatejobs.colocate.dev/finalizers",
        "patch colocatejobs.colocate.dev/status",
        "create pods",
        "get secrets",
    }
    refused = {
        "list secrets",
        "watch secrets",
        "delete secrets",
        "patch pods",
        "update colocatejobs.colocate.dev",
        "delete deployments.apps",
        "create colocatejobs.colocate.dev",
    }
    for check in sorted(allowed | refused):
        verb, resource = check.split()
        resource, _, subresource = resource.partition("/")
        args = ["auth", "can-i", verb, resource, "-n", namespace]
        answer = as_operator(
            cluster, operator_identity, *args, *([f"--subresource={subresource}"] * bool(subresource))
        )
        assert answer == ("yes" if check in allowed else "no"), (check, answer)
    # Nothing outside the watched namespace.
    assert as_operator(cluster, operator_identity, "auth", "can-i", "create", "pods", "-n", "default") == "no"


def test_ttl_deletes_the_finished_job_under_the_charts_rbac(
    cluster: Cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(
        cluster, namespace, runPolicy={"maxRestarts": 0, "backoffSeconds": 0, "ttlSecondsAfterFinished": 2}
    )
    wait_phase(cluster, namespace, "Running")
    running_pods(cluster, namespace, 2, 0)
    fail_pod(cluster, namespace, "demo-0")
    status = wait_phase(cluster, namespace, "Failed")
    assert status.get("completionTime")
    wait_for(
        lambda: cluster.kubectl("get", "colocatejob", "demo", "-n", namespace, check=False).returncode != 0,
        30,
        "the finished job deleted ttlSecondsAfterFinished after it finished",
    )
    assert "TTLExpired" in job_event_reasons(cluster, namespace)
    # Its children go with it (garbage collection through their ownerReferences).
    wait_for(
        lambda: (
            cluster.kubectl("get", "secret", "demo-metastore-auth", "-n", namespace, check=False).returncode
            != 0
        ),
        60,
        "the job's meta-store Secret garbage-collected",
    )
