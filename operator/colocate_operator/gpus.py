"""Pure builders for how a pod gets its GPUs, so that both containers see the same devices.

DRA: an operator-owned ResourceClaimTemplate; each pod gets one claim from it (named in
pod.spec.resourceClaims) and both containers list that claim, which gives them the same devices.
DevicePlugin: the device plugin allocates per container, so only the trainer can request GPUs; the rollout
container sees the node's GPUs through NVIDIA_VISIBLE_DEVICES=all and the runtime narrows to the trainer's
devices by UUID. That gives up isolation, so it is meant for whole nodes: when gpusPerNode is the node's GPU
count the trainer holds every GPU of the node, the scheduler places no other GPU pod there, and `all` is
exactly the trainer's set (pin such nodes with scheduling.nodeSelector, e.g. GPU feature discovery's
nvidia.com/gpu.count). With fewer, the rollout container can reach GPUs allocated to other pods: use DRA.
There is no per-container alternative: the device plugin hands a device to one container only.

Nothing else sets NVIDIA_VISIBLE_DEVICES: the CRD refuses it in user env (where the container toolkit
honours it for unprivileged containers it would widen a container's GPUs), and pods.py drops it as well.

Multi-node NVLink (GB200 NVL72 and the like), both optional and passed through, never interpreted here:
- where the pods land: Kueue topology-aware scheduling reads a pod-set annotation naming a node label level
  (a rack, a block, `nvidia.com/gpu.clique` for an NVLink domain) that the whole gang must (required) or
  should (preferred) share;
- the IMEX channel between them: NVIDIA's DRA driver gives pods on different nodes one ComputeDomain, whose
  controller makes a ResourceClaimTemplate for its channel; each pod gets a claim from it, listed by both
  containers (the trainer's NCCL and SGLang's multi-node TP both need it). Independent of how the GPUs
  themselves are allocated (DRA or DevicePlugin).
"""

from __future__ import annotations

from typing import Any

from colocate_operator import names
from colocate_operator.constants import (
    CLAIM_NAME,
    COMPONENT_WORKER,
    COMPUTE_DOMAIN_CLAIM_NAME,
    CONTAINER_TRAINER,
    GPU_TAINT_KEY,
    KUEUE_PREFERRED_TOPOLOGY_ANNOTATION,
    KUEUE_REQUIRED_TOPOLOGY_ANNOTATION,
)
from colocate_operator.spec import ColocateJob


def uses_dra(job: ColocateJob) -> bool:
    return job.spec.gpu.allocation == "DRA"


def claim_template(job: ColocateJob) -> dict[str, Any] | None:
    if not uses_dra(job):
        return None
    exactly: dict[str, Any] = {
        "deviceClassName": job.spec.gpu.device_class_name,
        "allocationMode": "ExactCount",
        "count": job.spec.gpus_per_node,
    }
    if job.spec.gpu.selectors:
        exactly["selectors"] = [{"cel": {"expression": expr}} for expr in job.spec.gpu.selectors]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": names.metadata(job.ref, names.claim_template(job.ref.name), COMPONENT_WORKER),
        "spec": {"spec": {"devices": {"requests": [{"name": CLAIM_NAME, "exactly": exactly}]}}},
    }


def pod_resource_claims(job: ColocateJob) -> list[dict[str, Any]]:
    claims = []
    if uses_dra(job):
        claims.append({"name": CLAIM_NAME, "resourceClaimTemplateName": names.claim_template(job.ref.name)})
    domain = job.spec.gpu.compute_domain
    if domain is not None:
        template = domain.resource_claim_template_name
        claims.append({"name": COMPUTE_DOMAIN_CLAIM_NAME, "resourceClaimTemplateName": template})
    return claims


def container_resources(job: ColocateJob, role: str, user: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The user's cpu/memory plus this container's share of the GPUs (and the ComputeDomain channel)."""
    resources: dict[str, Any] = {k: dict(v) for k, v in user.items() if k in ("requests", "limits") and v}
    claims = [{"name": c["name"]} for c in pod_resource_claims(job)]
    if claims:
        resources["claims"] = claims
    if not uses_dra(job) and role == CONTAINER_TRAINER:
        count = job.spec.gpus_per_node
        resources.setdefault("limits", {})[job.spec.gpu.resource_name] = count
        resources.setdefault("requests", {})[job.spec.gpu.resource_name] = count
    return resources


def container_env(job: ColocateJob, role: str) -> list[dict[str, Any]]:
    """DevicePlugin only: let the rollout container see the GPUs its trainer was given (see module doc)."""
    if uses_dra(job) or role == CONTAINER_TRAINER:
        return []
    return [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]


def topology_annotations(job: ColocateJob) -> dict[str, str]:
    """Kueue's TAS annotation for the worker pods (a pod-set annotation: every pod of the gang carries it)."""
    topology = job.spec.scheduling.topology
    if topology.required:
        return {KUEUE_REQUIRED_TOPOLOGY_ANNOTATION: topology.required}
    if topology.preferred:
        return {KUEUE_PREFERRED_TOPOLOGY_ANNOTATION: topology.preferred}
    return {}


def gpu_toleration() -> dict[str, Any]:
    # DRA bypasses the extended-resource toleration injection, so the GPU taint is tolerated explicitly.
    return {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
