"""The local control plane is real: CRDs, scheduling onto GPU nodes, DRA allocation, garbage collection."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.processes import ComponentError
from tests.kube import get_json, wait_for

pytestmark = pytest.mark.integration

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _pod(name: str, **spec: object) -> dict:
    containers = spec.pop("containers", [{"name": "main", "image": "busybox"}])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": containers, **spec},
    }


def _running_pod(cluster: Cluster, namespace: str, name: str) -> dict:
    def probe() -> dict | None:
        pod = get_json(cluster, "pod", name, "-n", namespace)
        return pod if pod["status"].get("phase") == "Running" else None

    return wait_for(probe, 60, f"pod {namespace}/{name} Running")


def test_binaries_are_version_stamped(cluster: Cluster) -> None:
    out = subprocess.run([cluster.bin_dir / "kube-apiserver", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == "Kubernetes v1.37.2"
    server = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert server["gitVersion"] == "v1.37.2"


def test_crd_established_and_custom_object_round_trips(cluster: Cluster, namespace: str) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.test.colocate.dev"},
        "spec": {
            "group": "test.colocate.dev",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"size": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    cluster.apply([crd])
    wait_for(
        lambda: (
            cluster.kubectl(
                "get",
                "crd",
                "widgets.test.colocate.dev",
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
            ).stdout
            == "True"
        ),
        30,
        "CRD Established",
    )
    widget = {
        "apiVersion": "test.colocate.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": namespace},
    }
    wait_for(
        lambda: (
            cluster.kubectl(
                "apply", "-f", "-", input=json.dumps({**widget, "spec": {"size": 3}}), check=False
            ).returncode
            == 0
        ),
        30,
        "custom object accepted",
    )
    assert get_json(cluster, "widget", "w", "-n", namespace)["spec"] == {"size": 3}
    # The schema is enforced by the real apiserver.
    bad = cluster.kubectl("apply", "-f", "-", input=json.dumps({**widget, "spec": {"size": 0}}), check=False)
    assert bad.returncode != 0 and "spec.size" in bad.stderr


def test_gpu_pod_is_scheduled_onto_a_fake_gpu_node_and_runs(cluster: Cluster, namespace: str) -> None:
    containers = [{"name": "main", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]
    pod = _pod("gpu", containers=containers, tolerations=[GPU_TOLERATION])
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    running = _running_pod(cluster, namespace, "gpu")
    assert running["spec"]["nodeName"].startswith("gpu-node-")
    # More GPUs than any node offers: the real scheduler leaves it Pending.
    greedy = [{"name": "main", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "9"}}}]
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(_pod("greedy", containers=greedy, tolerations=[GPU_TOLERATION])),
    )
    wait_for(
        lambda: any(
            c.get("reason") == "Unschedulable"
            for c in get_json(cluster, "pod", "greedy", "-n", namespace)["status"].get("conditions", [])
        ),
        30,
        "pod asking for 9 GPUs marked Unschedulable",
    )


def test_dra_claim_from_template_is_allocated_and_shared_by_two_containers(
    cluster: Cluster, namespace: str
) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpus"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 4}}
                    ]
                }
            }
        },
    }
    containers = [
        {"name": name, "image": "busybox", "resources": {"claims": [{"name": "gpus"}]}}
        for name in ("trainer", "sglang")
    ]
    pod = _pod(
        "dra",
        containers=containers,
        resourceClaims=[{"name": "gpus", "resourceClaimTemplateName": "gpus"}],
        tolerations=[GPU_TOLERATION],
    )
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [template, pod]}),
    )
    running = _running_pod(cluster, namespace, "dra")
    claim_name = running["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = get_json(cluster, "resourceclaim", claim_name, "-n", namespace)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 4
    assert {r["driver"] for r in results} == {"gpu.nvidia.com"}
    assert {r["pool"] for r in results} == {running["spec"]["nodeName"]}
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [running["metadata"]["uid"]]


def test_owned_object_is_garbage_collected_after_its_owner(cluster: Cluster, namespace: str) -> None:
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}, "data": {"a": "1"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(owner))
    uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(
        lambda: cluster.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0,
        60,
        "child ConfigMap garbage-collected by kube-controller-manager",
    )


def test_failed_start_names_the_component_and_leaves_no_process(cluster: Cluster, tmp_path: Path) -> None:
    """A component that dies during start-up: the error names it and quotes its log, and every process the
    launcher had started (here a real etcd) is stopped."""
    fake_bins = tmp_path / "bin"
    fake_bins.mkdir()
    for entry in cluster.bin_dir.iterdir():
        (fake_bins / entry.name).symlink_to(entry)
    (fake_bins / "kube-apiserver").unlink()
    (fake_bins / "kube-apiserver").write_text(
        "#!/bin/sh\necho 'failed to listen on 127.0.0.1:6443: bind: address already in use' >&2\nexit 1\n"
    )
    (fake_bins / "kube-apiserver").chmod(0o755)
    broken = Cluster(ClusterSpec(workdir=tmp_path / "work", bin_dir=fake_bins, verbose=False))
    with pytest.raises(ComponentError, match=r"kube-apiserver exited with code 1 \(a port it needs is taken"):
        broken.start()
    etcd = next(c for c in broken.components if c.name == "etcd")
    assert not etcd.alive()
    assert not os.path.exists(tmp_path / "work" / "state.json")
