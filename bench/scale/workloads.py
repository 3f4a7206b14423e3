"""The equivalent workloads the two operators are given, as plain manifests (pure functions).

Both occupy four whole GPU nodes per job: a ColocateJob of numNodes=4, gpusPerNode=8 with the DevicePlugin
allocation (its trainer container requests `nvidia.com/gpu: 8`), and a RayCluster with one head and three
workers, each requesting `nvidia.com/gpu: 8`. Every pod asks for the same 16 CPUs and 128 GiB in total, and
tolerates the GPU taint, so the scheduler does the same bin packing for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GPU = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
PODS_PER_JOB = 4
GPUS_PER_POD = 8
RAY_VERSION = "2.52.0"


@dataclass(frozen=True)
class Workload:
    """How one operator's jobs are named, created and recognised."""

    operator: str  # "colocate" | "colocate-managed" | "kuberay"
    kind: str  # "colocate" | "kuberay": which custom resource
    api_version: str
    plural: str
    pod_job_label: str  # the pod label whose value is the job's name

    def path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/{self.api_version}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{name}" if name else base

    def manifest(self, namespace: str, name: str, metastore_address: str = "") -> dict[str, Any]:
        if self.kind == "colocate":
            return colocate_job(namespace, name, metastore_address)
        return ray_cluster(namespace, name)

    def is_gpu_pod(self, pod: dict[str, Any]) -> bool:
        """The pods that count for "all pods Running": the four GPU pods of each job."""
        labels = pod["metadata"].get("labels") or {}
        if self.kind == "colocate":
            return labels.get("colocate.dev/component") == "worker"
        return self.pod_job_label in labels

    def job_ready(self, body: dict[str, Any]) -> bool:
        """The operator's own verdict that the job is up: phase Running / state ready."""
        status = body.get("status") or {}
        if self.kind == "colocate":
            return status.get("phase") == "Running"
        return status.get("state") == "ready"


# Ours as the benchmark runs it: jobs with an External meta-store (a Redis on this machine that the operator,
# running outside the cluster, can reach; a Managed one would be a kwok pod where nothing runs), and the
# operator's step-event daemon following it.
COLOCATE = Workload("colocate", "colocate", "colocate.dev/v1alpha1", "colocatejobs", "colocate.dev/job")
# Ours with the default Managed meta-store: a Redis Deployment, Service, Secret and NetworkPolicy per job.
COLOCATE_MANAGED = Workload(
    "colocate-managed", "colocate", "colocate.dev/v1alpha1", "colocatejobs", "colocate.dev/job"
)
KUBERAY = Workload("kuberay", "kuberay", "ray.io/v1", "rayclusters", "ray.io/cluster")
WORKLOADS = {w.operator: w for w in (COLOCATE, COLOCATE_MANAGED, KUBERAY)}
METASTORE_SECRET = "bench-redis"  # holds key "password" of the External meta-store

# Split across the two containers of a ColocateJob pod, whole in a Ray pod.
HALF = {"cpu": "8", "memory": "64Gi"}
WHOLE = {"cpu": "16", "memory": "128Gi"}


def job_name(index: int) -> str:
    return f"job-{index:04d}"


def colocate_job(namespace: str, name: str, metastore_address: str = "") -> dict[str, Any]:
    """Managed meta-store (the default: a Redis Deployment per job), or External at `metastore_address`."""
    container = {"resources": {"requests": dict(HALF), "limits": {"memory": HALF["memory"]}}}
    body: dict[str, Any] = {
        "apiVersion": COLOCATE.api_version,
        "kind": "ColocateJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": PODS_PER_JOB,
            "gpusPerNode": GPUS_PER_POD,
            "gpu": {"allocation": "DevicePlugin"},
            "model": {"arch": "qwen3"},
            "trainer": {"image": "example.com/trainer:bench", **container},
            "rollout": {"image": "example.com/sglang:bench", **container},
        },
    }
    if metastore_address:
        body["spec"]["metaStore"] = {
            "mode": "External",
            "external": {"address": metastore_address, "passwordSecretRef": {"name": METASTORE_SECRET}},
        }
    return body


def _ray_pod_template(container_name: str) -> dict[str, Any]:
    limits = {**WHOLE, GPU: str(GPUS_PER_POD)}
    return {
        "spec": {
            "tolerations": [dict(GPU_TOLERATION)],
            "containers": [
                {
                    "name": container_name,
                    "image": f"rayproject/ray:{RAY_VERSION}-gpu",
                    "resources": {"requests": dict(limits), "limits": dict(limits)},
                }
            ],
        }
    }


def ray_cluster(namespace: str, name: str) -> dict[str, Any]:
    workers = PODS_PER_JOB - 1
    return {
        "apiVersion": KUBERAY.api_version,
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": {"rayStartParams": {}, "template": _ray_pod_template("ray-head")},
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": _ray_pod_template("ray-worker"),
                }
            ],
        },
    }


def stored_sizes(body: dict[str, Any]) -> dict[str, int]:
    """How big an object is as the API server stores it (what each write decodes, patches, validates and
    encodes), and its parts, in compact JSON bytes."""

    def size(part: Any) -> int:
        return len(json.dumps(part, separators=(",", ":")))

    managed = (body.get("metadata") or {}).get("managedFields")
    return {
        "whole": size(body),
        "spec": size(body.get("spec")),
        "status": size(body.get("status")),
        "managed_fields": size(managed),
        "managers": len(managed or ()),
    }
