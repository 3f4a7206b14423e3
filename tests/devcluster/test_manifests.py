"""The seed objects of the local cluster, checked without a cluster."""

from __future__ import annotations

import pytest

from colocate_devcluster import manifests
from colocate_devcluster.binaries import MissingBinaries, find_bin_dir


@pytest.mark.parametrize("gpu_nodes,gpus", [(1, 1), (4, 8), (3, 2)])
def test_seed_objects_offer_each_gpu_twice_extended_resource_and_dra(gpu_nodes: int, gpus: int) -> None:
    objects = manifests.seed_objects(gpu_nodes, gpus)
    nodes = [o for o in objects if o["kind"] == "Node"]
    slices = [o for o in objects if o["kind"] == "ResourceSlice"]
    gpu_nodes_seen = [n for n in nodes if n["status"]["capacity"].get("nvidia.com/gpu")]
    assert len(gpu_nodes_seen) == gpu_nodes
    assert len(nodes) == gpu_nodes + 1  # plus one CPU node for pods without GPUs
    assert all(n["status"]["capacity"]["nvidia.com/gpu"] == str(gpus) for n in gpu_nodes_seen)
    assert all(n["spec"]["taints"] == [manifests.GPU_TAINT] for n in gpu_nodes_seen)
    assert sorted(s["spec"]["nodeName"] for s in slices) == sorted(
        n["metadata"]["name"] for n in gpu_nodes_seen
    )
    uuids = [d["attributes"]["uuid"]["string"] for s in slices for d in s["spec"]["devices"]]
    assert len(uuids) == len(set(uuids)) == gpu_nodes * gpus
    assert [o["kind"] for o in objects].count("DeviceClass") == 1


def test_gpu_uuids_are_stable_and_distinct() -> None:
    assert manifests.gpu_uuid("gpu-node-0", 0) == manifests.gpu_uuid("gpu-node-0", 0)
    assert manifests.gpu_uuid("gpu-node-0", 0) != manifests.gpu_uuid("gpu-node-1", 0)
    assert manifests.gpu_uuid("gpu-node-0", 3).startswith("GPU-")


def test_missing_binaries_name_what_is_missing_and_the_fix(tmp_path) -> None:
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    (tmp_path / "etcd").chmod(0o755)
    with pytest.raises(MissingBinaries, match=r"kube-apiserver.*make setup"):
        find_bin_dir(tmp_path)
