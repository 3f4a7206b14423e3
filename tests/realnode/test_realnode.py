"""Real containers on a real kubelet: a pod from the image built here runs to completion and its logs come
back through `kubectl logs`; the chart's operator Deployment, from the same image, becomes Ready on the real
node and reaches the apiserver in-cluster with its ServiceAccount (test_realnode_job.py: it reconciles a job
whose containers all run there). The node's GPUs come from the fake device plugin (devcluster/fakegpu, a
stand-in for NVIDIA's) through the kubelet: allocatable only while the plugin is registered, and a container
that asks for one gets the plugin's Allocate answer in its environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.realnode import (
    GPU_ENV,
    GPU_ID_PREFIX,
    GPU_RESOURCE,
    GPUS,
    REAL_NODE_LABEL,
    REAL_NODE_TOLERATION,
    node_name,
)
from tests.kube import get_json, wait_for
from tests.realnode.conftest import IMAGE_REPOSITORY, new_namespace

# The first test of the tier builds the images when their inputs changed (scripts/build-images.sh: minutes
# on a loaded machine after a source change) and starts the real node: beyond the suite's default timeout.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


def test_real_node_joins_beside_kwok_nodes(real_cluster: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in get_json(real_cluster, "nodes")["items"]}
    real = nodes[node_name(0)]
    assert real["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {"gpu-node-0", "cpu-node-0"} <= set(nodes)  # the kwok nodes are still there


def run_pod(
    cluster: Cluster, namespace: str, name: str, command: list[str], resources: dict | None = None
) -> str:
    """A pod of one container from the operator's image on the real node, run to its end: its log."""
    container = {
        "name": "c",
        "image": f"{IMAGE_REPOSITORY}:0.1.0",
        "imagePullPolicy": "Never",
        "command": command,
        **({"resources": resources} if resources else {}),
    }
    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "nodeSelector": {REAL_NODE_LABEL: "true"},
                    "tolerations": [REAL_NODE_TOLERATION],
                    "restartPolicy": "Never",
                    "containers": [container],
                },
            }
        ]
    )

    def finished() -> str | None:
        phase = get_json(cluster, "pod", name, "-n", namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    assert wait_for(finished, 60, f"pod {name} to finish") == "Succeeded"
    return cluster.kubectl("logs", name, "-n", namespace).stdout


def test_pod_runs_to_completion_and_its_logs_are_readable(real_cluster: Cluster) -> None:
    namespace = new_namespace(real_cluster)
    script = "import os, sys; print('ran', sys.version_info[:2], 'as uid', os.getuid())"
    logs = run_pod(real_cluster, namespace, "hello", ["python", "-c", script])
    assert logs.strip() == "ran (3, 11) as uid 10001"  # the image's non-root user, Debian's python3.11


def _gpus(cluster: Cluster, field: str) -> str | None:
    return get_json(cluster, "node", node_name(0))["status"].get(field, {}).get(GPU_RESOURCE)


def test_the_nodes_gpus_are_the_device_plugins_allocatable_only_while_it_is_registered(
    real_cluster: Cluster,
) -> None:
    node = real_cluster.real_nodes[0]
    log = Path(node.gpu_plugin.log_path)
    wait_for(lambda: _gpus(real_cluster, "allocatable") == str(GPUS), 60, f"{GPUS} GPUs allocatable")
    assert f"registered {GPU_RESOURCE} with the kubelet: {GPUS} devices" in log.read_text()
    assert "ListAndWatch" in log.read_text()  # the kubelet asked for the devices

    node.stop_gpu_plugin()  # its socket goes, its stream to the kubelet ends
    try:
        wait_for(lambda: _gpus(real_cluster, "allocatable") == "0", 60, "0 GPUs allocatable, plugin stopped")
    finally:
        registrations = log.read_text().count("registered ")
        node.start_gpu_plugin()
    wait_for(lambda: log.read_text().count("registered ") > registrations, 60, "the plugin registered again")
    wait_for(lambda: _gpus(real_cluster, "allocatable") == str(GPUS), 60, f"{GPUS} GPUs allocatable again")
    assert _gpus(real_cluster, "capacity") == str(GPUS)


def test_a_container_asking_for_a_gpu_gets_the_device_plugins_allocation(real_cluster: Cluster) -> None:
    namespace = new_namespace(real_cluster)
    gpu = {"limits": {GPU_RESOURCE: 1}, "requests": {GPU_RESOURCE: 1}}
    logs = run_pod(real_cluster, namespace, "gpu", ["sh", "-c", f'echo "{GPU_ENV}=${GPU_ENV}"'], gpu)
    match = re.fullmatch(rf"{GPU_ENV}=({re.escape(GPU_ID_PREFIX)}\d+)", logs.strip())
    assert match, logs  # one of the plugin's devices, from its Allocate answer (the image sets no such env)
    log = Path(real_cluster.real_nodes[0].gpu_plugin.log_path).read_text()
    assert f"Allocate: {GPU_ENV}={match.group(1)}" in log, log[-2000:]
    # Without a GPU request the kubelet calls no Allocate: the variable stays unset.
    bare = run_pod(real_cluster, namespace, "no-gpu", ["sh", "-c", f'echo "{GPU_ENV}=${{{GPU_ENV}:-unset}}"'])
    assert bare.strip() == f"{GPU_ENV}=unset"


def test_operator_deployment_from_the_chart_becomes_ready_on_the_real_node(
    real_cluster: Cluster, operator_namespace: str
) -> None:
    namespace = operator_namespace
    pods = get_json(real_cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=op")["items"]
    assert len(pods) == 1
    pod = pods[0]
    assert pod["spec"]["nodeName"] == node_name(0)
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0, status
    # In-cluster, through its ServiceAccount: kopf reached the apiserver by name (the node's DNS and route).
    name = pod["metadata"]["name"]

    def logged_in() -> str | None:
        logs = real_cluster.kubectl("logs", name, "-n", namespace).stdout
        return logs if "Initial authentication has finished" in logs and "/healthz" in logs else None

    logs = wait_for(logged_in, 60, "the operator's login and a liveness probe in its log")
    assert "Failed to resolve" not in logs and "ClientConnectorDNSError" not in logs, logs[-3000:]
    assert "API discovery" not in logs, logs[-3000:]
