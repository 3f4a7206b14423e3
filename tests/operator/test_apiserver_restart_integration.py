"""The API server restarted mid-reconcile (issue 17, item 16): the real kube-apiserver of the local plane is
stopped and started again (same port, same etcd) while the operator is creating a job's pods one at a time
and a step follower has news to write. Every connection and watch of the operator breaks. Once the apiserver
is back the operator converges: each job has exactly its pods (no duplicates), status catches up with what
happened while the apiserver was down, and a job created afterwards is reconciled (the watches came back)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from tests.kube import ChartIdentity, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, get, job_status, pods, running_pods, wait_phase
from tests.operator.test_stepwatch_integration import GPUS, emit, start_job, status

pytestmark = pytest.mark.integration

DOWN_SECONDS = 5.0


def job_children(cluster: Any, namespace: str, job: str) -> dict[str, list[str]]:
    """The job's objects by kind (uids); its pods' ResourceClaims (made by kube from the operator's template)
    found through their owner."""
    selector = f"colocate.dev/job={job}"
    found = get(cluster, namespace, "pods,secrets,services,deployments", "-l", selector)["items"]
    pod_uids = {item["metadata"]["uid"] for item in found if item["kind"] == "Pod"}
    found += [
        claim
        for claim in get(cluster, namespace, "resourceclaims")["items"]
        if {o["uid"] for o in claim["metadata"].get("ownerReferences") or []} & pod_uids
    ]
    children: dict[str, list[str]] = {}
    for item in found:
        children.setdefault(item["kind"], []).append(item["metadata"]["uid"])
    return {kind: sorted(uids) for kind, uids in children.items()}


@pytest.mark.timeout(420)
def test_apiserver_restarted_mid_reconcile_the_operator_converges_without_duplicates(
    cluster: Any,
    namespace: str,
    tmp_path: Path,
    operator_identity: ChartIdentity,
    redis_server: RedisServer,
) -> None:
    operator = OperatorProcess(
        namespace, tmp_path / "operator.log", operator_identity, COLOCATE_CREATE_DELAY_SECONDS="1"
    ).start()
    try:
        start_job(cluster, namespace, redis_server)  # "steps": External meta-store, our real Redis
        apply_job(cluster, namespace, numNodes=4, gpusPerNode=1)  # "demo": Managed, pods created 1 s apart
        wait_for(lambda: len(pods(cluster, namespace)) >= 1, 60, "demo's first pod created")

        cluster.stop_component("kube-apiserver")
        try:
            # News the step follower cannot write while the apiserver is down.
            client = redis_server.client()
            for gpu in GPUS:
                emit(client, namespace, 1, gpu)
            time.sleep(DOWN_SECONDS)
            assert operator.process is not None and operator.process.poll() is None, (
                "the operator exited while the apiserver was down:\n" + operator.log()[-3000:]
            )
        finally:
            cluster.start_component("kube-apiserver")

        # Converged: demo's group complete and Running, no pod twice; step 1 reached status.
        wait_phase(cluster, namespace, "Running", timeout=180)
        items = running_pods(cluster, namespace, 4, 0)
        assert sorted(p["metadata"]["labels"]["colocate.dev/replica-index"] for p in items) == list("0123")
        wait_for(
            lambda: status(cluster, namespace).get("weightSync", {}).get("lastCompletedStep") == 1,
            120,
            "step 1, emitted while the apiserver was down, in the job's status",
        )
        demo = job_status(cluster, namespace)
        assert demo["groupCreated"] is True and demo["restarts"] == 0
        children = job_children(cluster, namespace, "demo")
        assert len(children["Pod"]) == 4 + 1, children  # four workers and the Managed Redis
        assert len(children["Secret"]) == 1 and len(children["Deployment"]) == 1, children
        assert len(children.get("ResourceClaim", [])) == 4, children

        # The watches came back: a job created now is reconciled, and nothing above changes on later passes.
        apply_job(cluster, namespace, name="after", numNodes=1, gpusPerNode=1)
        wait_phase(cluster, namespace, "Running", timeout=90, name="after")
        time.sleep(5)  # two reconcile intervals of the test operator
        assert job_children(cluster, namespace, "demo") == children
        assert operator.process is not None and operator.process.poll() is None
    finally:
        operator.stop()
