"""Real containers on a real kubelet: a pod from the image built here runs to completion and its logs come
back through `kubectl logs`; the chart's operator Deployment, from the same image, becomes Ready on the real
node and reaches the apiserver in-cluster with its ServiceAccount (test_realnode_job.py: it reconciles a job
whose containers all run there)."""

from __future__ import annotations

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.realnode import REAL_NODE_LABEL, REAL_NODE_TOLERATION, node_name
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


def test_pod_runs_to_completion_and_its_logs_are_readable(real_cluster: Cluster) -> None:
    namespace = new_namespace(real_cluster)
    script = "import os, sys; print('ran', sys.version_info[:2], 'as uid', os.getuid())"
    real_cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "hello", "namespace": namespace},
                "spec": {
                    "nodeSelector": {REAL_NODE_LABEL: "true"},
                    "tolerations": [REAL_NODE_TOLERATION],
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "py",
                            "image": f"{IMAGE_REPOSITORY}:0.1.0",
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", script],
                        }
                    ],
                },
            }
        ]
    )

    def finished() -> str | None:
        phase = get_json(real_cluster, "pod", "hello", "-n", namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    assert wait_for(finished, 60, "the pod to finish") == "Succeeded"
    logs = real_cluster.kubectl("logs", "hello", "-n", namespace).stdout
    assert logs.strip() == "ran (3, 11) as uid 10001"  # the image's non-root user, Debian's python3.11


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
