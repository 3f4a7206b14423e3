"""A local control plane with a real node beside a kwok node: kubelet v1.37.2, containerd, runc and CNI on
this machine, running images built here (scripts/build-images.sh). Skipped only where the machine cannot
run a real node (colocate_devcluster.realnode.can_run says why: not root, or containerd, runc or the CNI
plugins absent)."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator

import pytest

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.realnode import can_run
from demo.realnode_demo import OPERATOR_REPOSITORY, RESTRICTED, build_images, chart_values
from tests.kube import CHART, helm

SLOW = os.environ.get("COLOCATE_SLOW_TESTS") == "1"  # the slow set: the demo on real containers too
IMAGE_REPOSITORY = OPERATOR_REPOSITORY  # what scripts/build-images.sh tags, the chart's appVersion


def new_namespace(cluster: Cluster, labels: dict[str, str] | None = None) -> str:
    name = f"rn-{secrets.token_hex(4)}"
    cluster.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}]
    )
    return name


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = can_run()
    if why:
        pytest.skip(f"this machine cannot run a real node: {why}")
    # The images are cached by their inputs: a warm run takes about 10-20 s (each image started once), a
    # cold one 10 min at load average 15 (two mmdebstrap runs, pip, a 1.3 GB runtime image saved).
    # With the worker image (1.3 GB: a minute to import into each new containerd, more to rebuild after a
    # source change) for the job on real containers (test_realnode_job.py).
    built = build_images(with_runtime=True)
    rebuilt = [line for line in built if " built in " in line or " made in " in line]
    print("\n".join([*rebuilt, built[-1]]), file=sys.stderr)  # what it cost
    cluster = Cluster(ClusterSpec(workdir=tmp_path_factory.mktemp("realnode"), gpu_nodes=2, real_nodes=1))
    cluster.start()
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        print(f"\n[devcluster] real-node logs kept in {cluster.workdir}/realnode-0", file=sys.stderr)


@pytest.fixture(scope="session")
def job_namespace(real_cluster: Cluster) -> str:
    return new_namespace(real_cluster, RESTRICTED)


@pytest.fixture(scope="session")
def operator_namespace(real_cluster: Cluster, job_namespace: str) -> str:
    """The chart installed with the image built here, its operator pinned to the real node and managing the
    job's namespace (the chart's default RBAC: a Role there, nothing cluster-wide but reads)."""
    namespace = new_namespace(real_cluster)
    helm(
        real_cluster, "install", "op", str(CHART), "--namespace", namespace,
        *chart_values(job_namespace), "--wait", "--timeout", "90s",
    )  # fmt: skip
    return namespace
