"""Pure builders for what the local cluster is seeded with: a kubeconfig, fake GPU nodes, DRA objects."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

GPU_DRIVER = "gpu.nvidia.com"  # the DRA driver name NVIDIA's driver uses; also our DeviceClass name
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
GPU_NODE_LABEL = "colocate.dev/gpu-node"
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


def kubeconfig(server: str, ca_cert: Path, token: str, user: str = "admin") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "devcluster", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": user}}],
        "current-context": "devcluster",
    }


def _node(name: str, labels: dict[str, str], capacity: dict[str, str], taints: list[dict[str, str]]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok", **labels},
        },
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def gpu_node_name(index: int) -> str:
    return f"gpu-node-{index}"


def gpu_uuid(node: str, device: int) -> str:
    """Stable fake GPU UUIDs in NVIDIA's format, so tests can rely on them across restarts."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}/{device}"))


def fake_nodes(gpu_nodes: int, gpus_per_node: int, cpu_nodes: int = 1) -> list[dict]:
    """GPU nodes (tainted like real GPU pools, offering the extended resource) plus untainted CPU nodes for
    pods that need no GPU, such as a job's Redis meta-store."""
    base = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    nodes = [
        _node(
            gpu_node_name(i),
            {GPU_NODE_LABEL: "true"},
            {**base, GPU_RESOURCE: str(gpus_per_node)},
            [GPU_TAINT],
        )
        for i in range(gpu_nodes)
    ]
    nodes += [_node(f"cpu-node-{i}", {}, base, []) for i in range(cpu_nodes)]
    return nodes


def device_class() -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": GPU_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]},
    }


def resource_slice(node: str, gpus: int) -> dict:
    """What a DRA driver would publish for one node: one pool, one device per GPU."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{GPU_DRIVER}"},
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": f"gpu-{d}",
                    "attributes": {
                        "uuid": {"string": gpu_uuid(node, d)},
                        "productName": {"string": "NVIDIA H200"},
                        "index": {"int": d},
                    },
                    "capacity": {"memory": {"value": "141Gi"}},
                }
                for d in range(gpus)
            ],
        },
    }


def seed_objects(gpu_nodes: int, gpus_per_node: int) -> list[dict]:
    """Everything a fresh cluster gets: nodes, the GPU DeviceClass and one ResourceSlice per GPU node."""
    slices = [resource_slice(gpu_node_name(i), gpus_per_node) for i in range(gpu_nodes)]
    return [*fake_nodes(gpu_nodes, gpus_per_node), device_class(), *slices]


def node_role_binding(node: str) -> dict:
    """Binds the built-in ClusterRole system:node to one real node's kubelet user (RBAC stands in for the
    Node authorizer, which this cluster does not run)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"colocate-devcluster:{node}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
        "subjects": [
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": f"system:node:{node}"}
        ],
    }
