"""Real containers on a real kubelet: a pod from the image built here runs to completion and its logs come
back through `kubectl logs`; the chart's operator Deployment, from the same image, becomes Ready on the real
node and reaches the apiserver in-cluster with its ServiceAccount."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import yaml

from colocate_devcluster import Cluster
from colocate_devcluster.realnode import REAL_NODE_LABEL, REAL_NODE_TOLERATION, node_name
from tests.kube import CHART, ROOT, get_json, helm, wait_for

pytestmark = pytest.mark.integration

IMAGE_REPOSITORY = "localhost/colocate-operator"  # what scripts/build-images.sh tags, the chart's appVersion
ON_REAL_NODE = (
    "--set-json", f'nodeSelector={{"{REAL_NODE_LABEL}":"true"}}',
    "--set-json", f"tolerations={json.dumps([REAL_NODE_TOLERATION])}",
)  # fmt: skip


def _namespace(cluster: Cluster) -> str:
    name = f"rn-{secrets.token_hex(4)}"
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
    return name


def test_real_node_joins_beside_kwok_nodes(real_cluster: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in get_json(real_cluster, "nodes")["items"]}
    real = nodes[node_name(0)]
    assert real["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {"gpu-node-0", "cpu-node-0"} <= set(nodes)  # the kwok nodes are still there


def test_pod_runs_to_completion_and_its_logs_are_readable(real_cluster: Cluster) -> None:
    namespace = _namespace(real_cluster)
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


@pytest.fixture(scope="module")
def operator_namespace(real_cluster: Cluster) -> str:
    """The chart installed with the image built here, its operator pinned to the real node."""
    namespace = _namespace(real_cluster)
    helm(
        real_cluster, "install", "op", str(CHART), "--namespace", namespace,
        "--set", f"image.repository={IMAGE_REPOSITORY}", "--set", "image.pullPolicy=Never",
        *ON_REAL_NODE, "--wait", "--timeout", "90s",
    )  # fmt: skip
    return namespace


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


def test_operator_in_cluster_reconciles_a_job(real_cluster: Cluster, operator_namespace: str) -> None:
    """The operator, a real container on the real node, reconciles the example job (its Redis, Secret,
    Services and worker pods land on the kwok nodes, as in the demo)."""
    job = yaml.safe_load(Path(ROOT / "examples" / "colocatejob.yaml").read_text())
    job["spec"].pop("metaStore", None)  # Managed: the operator makes the job's Redis itself
    job["metadata"]["namespace"] = namespace = _namespace(real_cluster)
    real_cluster.apply([job])

    def conditions() -> dict[str, str] | None:
        status = get_json(real_cluster, "colocatejob", job["metadata"]["name"], "-n", namespace).get(
            "status", {}
        )
        found = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return found if found.get("MetaStoreReady") == "True" and found.get("PodsReady") == "True" else None

    wait_for(conditions, 60, "MetaStoreReady and PodsReady from the in-cluster operator")
    pods = get_json(real_cluster, "pods", "-n", namespace)["items"]
    assert pods and all(p["spec"]["nodeName"] != node_name(0) for p in pods)
