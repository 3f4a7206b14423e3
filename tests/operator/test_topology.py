"""Topology hints and the ComputeDomain claim as pure manifests: Kueue TAS annotations on every worker pod,
and the channel claim in the pod and in both containers (the CRD's rules: test_topology_integration.py)."""

from __future__ import annotations

from typing import Any

import pytest

from colocate_operator import gpus, metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    KUEUE_PREFERRED_TOPOLOGY_ANNOTATION,
    KUEUE_REQUIRED_TOPOLOGY_ANNOTATION,
)
from colocate_operator.spec import ColocateJob
from tests.operator import factories

CONFIG = OperatorConfig()
RACK = "cloud.provider.com/topology-rack"
CLIQUE = "nvidia.com/gpu.clique"


def all_pods(job: ColocateJob) -> list[dict[str, Any]]:
    return pods.pods(job, 0, metastore.endpoint(job, CONFIG), CONFIG)


@pytest.mark.parametrize(
    ("topology", "expected"),
    [
        ({}, {}),
        ({"required": CLIQUE}, {KUEUE_REQUIRED_TOPOLOGY_ANNOTATION: CLIQUE}),
        ({"preferred": RACK}, {KUEUE_PREFERRED_TOPOLOGY_ANNOTATION: RACK}),
    ],
)
def test_topology_hint_is_on_every_worker_pod(topology: dict[str, str], expected: dict[str, str]) -> None:
    job = factories.job(numNodes=4, gpusPerNode=4, scheduling={"queueName": "gpus", "topology": topology})
    assert gpus.topology_annotations(job) == expected
    for pod in all_pods(job):
        annotations = pod["metadata"].get("annotations") or {}
        tas = {k: v for k, v in annotations.items() if "topology" in k}
        assert tas == expected, pod["metadata"]["name"]


def test_topology_hint_wins_over_a_user_annotation_of_the_same_key() -> None:
    job = factories.job(
        scheduling={"topology": {"required": CLIQUE}},
        pod={"annotations": {KUEUE_REQUIRED_TOPOLOGY_ANNOTATION: "kubernetes.io/hostname", "team": "rl"}},
    )
    annotations = all_pods(job)[0]["metadata"]["annotations"]
    assert annotations == {KUEUE_REQUIRED_TOPOLOGY_ANNOTATION: CLIQUE, "team": "rl"}


@pytest.mark.parametrize("allocation", ["DRA", "DevicePlugin"])
def test_compute_domain_channel_is_claimed_by_the_pod_and_both_containers(allocation: str) -> None:
    job = factories.job(
        gpu={"allocation": allocation, "computeDomain": {"resourceClaimTemplateName": "nvl72-channel"}}
    )
    channel = {"name": "compute-domain", "resourceClaimTemplateName": "nvl72-channel"}
    gpu_claim = {"name": "gpus", "resourceClaimTemplateName": "demo-gpus"}
    for pod in all_pods(job):
        spec = pod["spec"]
        assert spec["resourceClaims"] == ([gpu_claim, channel] if allocation == "DRA" else [channel])
        for container in spec["containers"]:
            names = [c["name"] for c in container["resources"]["claims"]]
            assert names == (["gpus", "compute-domain"] if allocation == "DRA" else ["compute-domain"])
        trainer, rollout = spec["containers"]
        if allocation == "DevicePlugin":  # the GPUs still come from the device plugin, to the trainer
            assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
            assert "limits" not in rollout["resources"]
    # The operator makes no claim template for the channel: the ComputeDomain's controller does.
    template = gpus.claim_template(job)
    assert template is None or template["metadata"]["name"] == "demo-gpus"


def test_no_compute_domain_no_extra_claim() -> None:
    for allocation, expected in (("DRA", [{"name": "gpus"}]), ("DevicePlugin", None)):
        job = factories.job(gpu={"allocation": allocation})
        trainer = all_pods(job)[0]["spec"]["containers"][0]
        assert trainer["resources"].get("claims") == expected
