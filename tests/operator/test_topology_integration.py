"""Topology hints and the ComputeDomain claim on the real plane: the API server's CRD accepts the fields
and refuses bad ones with messages that name them; a job that asks for both gets pods that carry Kueue's
annotation and are scheduled with the GPU claim and a ComputeDomain channel claim allocated side by side.

No NVIDIA driver runs here: a DeviceClass and one ResourceSlice per GPU node with one channel device stand
in for what the ComputeDomain controller and the compute-domain kubelet plugin publish, and a
ResourceClaimTemplate asking for one channel stands in for the one the ComputeDomain controller creates."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    get,
    job_manifest,
    job_status,
    running_pods,
    wait_phase,
)

pytestmark = pytest.mark.integration

CHANNEL_DRIVER = "compute-domain.nvidia.com"
CLIQUE = "nvidia.com/gpu.clique"

ACCEPTED = [
    ("required-clique", {"scheduling": {"topology": {"required": CLIQUE}}}),
    ("preferred-rack", {"scheduling": {"topology": {"preferred": "cloud.provider.com/topology-rack"}}}),
    ("unprefixed-key", {"scheduling": {"topology": {"required": "rack"}}}),
    ("compute-domain", {"gpu": {"computeDomain": {"resourceClaimTemplateName": "nvl72.channel-0"}}}),
    (
        "compute-domain-with-device-plugin",
        {"gpu": {"allocation": "DevicePlugin", "computeDomain": {"resourceClaimTemplateName": "channel"}}},
    ),
]

REJECTED = [
    (
        "both-topologies",
        {"scheduling": {"topology": {"required": CLIQUE, "preferred": "rack"}}},
        "spec.scheduling.topology: set required or preferred, not both",
    ),
    (
        "topology-key-with-space",
        {"scheduling": {"topology": {"required": "gpu clique"}}},
        "spec.scheduling.topology.required must be a node label key",
    ),
    (
        "topology-key-two-slashes",
        {"scheduling": {"topology": {"preferred": "a/b/c"}}},
        "spec.scheduling.topology.preferred must be a node label key",
    ),
    (
        "compute-domain-without-template",
        {"gpu": {"computeDomain": {}}},
        "spec.gpu.computeDomain.resourceClaimTemplateName: Required value",
    ),
    (
        "compute-domain-bad-template-name",
        {"gpu": {"computeDomain": {"resourceClaimTemplateName": "NVL72_channel"}}},
        "spec.gpu.computeDomain.resourceClaimTemplateName must be a ResourceClaimTemplate name",
    ),
]


def dry_run_create(cluster, namespace: str, name: str, override: dict[str, Any]):
    manifest = job_manifest(name[:40], namespace, **override)
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)


def test_crd_accepts_topology_and_compute_domain(cluster, crd, namespace: str) -> None:
    for case, override in ACCEPTED:
        result = dry_run_create(cluster, namespace, case, override)
        assert result.returncode == 0, (case, result.stderr)


@pytest.mark.parametrize(("case", "override", "message"), REJECTED, ids=[c[0] for c in REJECTED])
def test_crd_rejects_bad_topology_and_compute_domain(
    cluster, crd, namespace: str, case: str, override: dict[str, Any], message: str
) -> None:
    result = dry_run_create(cluster, namespace, case, override)
    assert result.returncode != 0, f"{case} was accepted"
    assert message in result.stderr, result.stderr


def test_compute_domain_is_immutable_like_the_rest_of_gpu(cluster, crd, namespace: str) -> None:
    apply_job(cluster, namespace)
    patch = {"spec": {"gpu": {"computeDomain": {"resourceClaimTemplateName": "channel"}}}}
    result = cluster.kubectl(
        "patch", "colocatejob", "demo", "-n", namespace, "--type=merge", "-p", json.dumps(patch),
        "--dry-run=server", check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "spec.gpu is immutable" in result.stderr, result.stderr


@pytest.fixture
def channels(cluster, namespace: str) -> Iterator[str]:
    """A stand-in ComputeDomain channel: its DeviceClass, one channel device per GPU node, and the claim
    template in the job's namespace. Returns the template's name; cluster-scoped parts are removed after."""
    device_class = f"cd-channel-{secrets.token_hex(3)}.nvidia.com"
    nodes = [
        n["metadata"]["name"]
        for n in get(cluster, "default", "nodes", "-l", "colocate.dev/gpu-node")["items"]
    ]
    assert nodes, "no GPU nodes"
    slices = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{device_class}"},
            "spec": {
                "driver": CHANNEL_DRIVER,
                "nodeName": node,
                "pool": {"name": f"{node}-{device_class}", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "channel-0", "attributes": {"type": {"string": "channel"}}}],
            },
        }
        for node in nodes
    ]
    cluster.apply(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": device_class},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{CHANNEL_DRIVER}"'}}]},
            },
            *slices,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "nvl72-channel", "namespace": namespace},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "channel",
                                    "exactly": {
                                        "deviceClassName": device_class,
                                        "allocationMode": "ExactCount",
                                        "count": 1,
                                    },
                                }
                            ]
                        }
                    }
                },
            },
        ]
    )
    try:
        yield "nvl72-channel"
    finally:
        names = [f"resourceslice/{s['metadata']['name']}" for s in slices]
        cluster.kubectl("delete", f"deviceclass/{device_class}", *names, "--wait=false", check=False)


def test_pods_carry_the_topology_hint_and_both_claims_are_allocated(
    cluster, namespace: str, operator_process: OperatorProcess, channels: str
) -> None:
    apply_job(
        cluster,
        namespace,
        gpusPerNode=4,
        gpu={"computeDomain": {"resourceClaimTemplateName": channels}},
        scheduling={"topology": {"required": CLIQUE}},
    )
    wait_phase(cluster, namespace, "Running")
    items = running_pods(cluster, namespace, 2, 0)
    claims = {c["metadata"]["name"]: c for c in get(cluster, namespace, "resourceclaims")["items"]}
    gpu_claims = set()
    for pod in items:
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == CLIQUE
        assert pod["spec"]["resourceClaims"] == [
            {"name": "gpus", "resourceClaimTemplateName": "demo-gpus"},
            {"name": "compute-domain", "resourceClaimTemplateName": channels},
        ]
        for container in pod["spec"]["containers"]:
            assert container["resources"]["claims"] == [{"name": "gpus"}, {"name": "compute-domain"}]
        by_claim = {s["name"]: s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"]}
        node = pod["spec"]["nodeName"]
        gpu_claims.add(by_claim["gpus"])
        gpu_results = claims[by_claim["gpus"]]["status"]["allocation"]["devices"]["results"]
        assert len(gpu_results) == 4 and {r["driver"] for r in gpu_results} == {"gpu.nvidia.com"}
        (channel,) = claims[by_claim["compute-domain"]]["status"]["allocation"]["devices"]["results"]
        assert (channel["driver"], channel["device"]) == (CHANNEL_DRIVER, "channel-0")
        assert channel["pool"].startswith(f"{node}-"), "the channel of the pod's own node"
    # status.resourceClaims reports the GPU claims (the channel is the ComputeDomain's business).
    assert {c["claim"] for c in job_status(cluster, namespace)["resourceClaims"]} == gpu_claims
