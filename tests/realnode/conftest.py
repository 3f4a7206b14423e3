"""A local control plane with a real node beside a kwok node: kubelet v1.37.2, containerd, runc and CNI on
this machine, running images built here (scripts/build-images.sh). Skipped only where the machine cannot
run a real node (colocate_devcluster.realnode.can_run says why: not root, or containerd, runc or the CNI
plugins absent)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.realnode import can_run
from tests.kube import ROOT


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = can_run()
    if why:
        pytest.skip(f"this machine cannot run a real node: {why}")
    # The images are cached: a warm run takes about 2 s, a cold one about 2 min (mmdebstrap, pip).
    script = ROOT / "scripts" / "build-images.sh"
    built = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert built.returncode == 0, f"scripts/build-images.sh failed:\n{built.stderr[-3000:]}"
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
