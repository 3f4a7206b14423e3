"""The Helm chart: lint, render for several value sets, validate against the real API server, and install,
upgrade and uninstall on the local control plane."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from colocate_devcluster import Cluster
from tests.kube import get_json, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "colocate-operator"

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "no-metrics": ["--set", "metrics.enabled=false", "--set", "logFormat=plain", "--set", "verbose=true"],
    "external-sa": [
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=ops",
        "--set",
        "rbac.create=false",
    ],
}


def helm(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(cluster.bin_dir / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def render(cluster: Cluster, *values: str, namespace: str = "colocate-system") -> list[dict]:
    out = helm(cluster, "template", "rel", str(CHART), "--namespace", namespace, *values).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_crd_is_the_operator_crd() -> None:
    ours = (ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml").read_bytes()
    assert (CHART / "crds" / "colocatejobs.colocate.dev.yaml").read_bytes() == ours, "run `make chart-crd`"


@pytest.mark.integration
@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={a}"]])
def test_helm_lint(cluster: Cluster, values: list[str]) -> None:
    helm(cluster, "lint", "--strict", str(CHART), *values)


@pytest.mark.integration
def test_values_schema_rejects_bad_values(cluster: Cluster) -> None:
    for bad in (
        ["--set", "logFormat=xml"],
        ["--set", "health.port=0"],
        ["--set", "watchNamespaces={Bad_NS}"],
        ["--set", "unknownKey=1"],
    ):
        result = helm(cluster, "template", "rel", str(CHART), *bad, check=False)
        assert result.returncode != 0 and "schema" in result.stderr.lower(), (bad, result.stderr)


@pytest.mark.integration
def test_operator_deployment_is_hardened(cluster: Cluster) -> None:
    (deployment,) = by_kind(render(cluster), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"requests", "limits"} <= set(container["resources"])
    assert "--metrics-port=9090" in container["args"]


@pytest.mark.integration
def test_rbac_is_cluster_wide_or_limited_to_listed_namespaces(cluster: Cluster) -> None:
    wide = render(cluster)
    roles = {r["metadata"]["name"]: r for r in by_kind(wide, "ClusterRole")}
    assert set(roles) == {"rel-colocate-operator", "rel-colocate-operator-discovery"}
    assert not by_kind(wide, "Role")
    narrow = render(cluster, *VALUE_SETS["namespaced"])
    (discovery,) = by_kind(narrow, "ClusterRole")
    # Cluster-wide, the operator may only read CRDs and namespaces.
    assert {verb for rule in discovery["rules"] for verb in rule["verbs"]} == {"get", "list", "watch"}
    assert sorted(r["metadata"]["namespace"] for r in by_kind(narrow, "Role")) == ["team-a", "team-b"]
    (deployment,) = by_kind(narrow, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    # No write verb on secrets anywhere cluster-wide when limited to namespaces.
    assert not any("secrets" in rule.get("resources", []) for rule in discovery["rules"])


@pytest.mark.integration
def test_service_monitor_is_optional(cluster: Cluster) -> None:
    assert not by_kind(render(cluster), "ServiceMonitor")
    (monitor,) = by_kind(render(cluster, "--set", "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_pass_server_side_dry_run(cluster: Cluster, namespace: str, name: str) -> None:
    values = VALUE_SETS[name]
    if name == "namespaced":  # Roles go into the listed namespaces: use ones that exist
        values = ["--set", f"watchNamespaces={{{namespace}}}"]
    docs = render(cluster, *values, namespace=namespace)
    docs = [d for d in docs if d["kind"] != "Pod"]  # the helm-test hook pod is covered by install below
    result = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
def test_install_upgrade_uninstall(cluster: Cluster, namespace: str) -> None:
    helm(cluster, "install", "op", str(CHART), "--namespace", namespace, "--wait", "--timeout", "120s")
    assert get_json(cluster, "crd", "colocatejobs.colocate.dev")["spec"]["names"]["shortNames"] == ["cjob"]
    deployment = get_json(cluster, "deployment", "op-colocate-operator", "-n", namespace)
    assert deployment["status"].get("availableReplicas") == 1  # kwok runs the pod on the CPU node
    notes = helm(cluster, "get", "notes", "op", "--namespace", namespace).stdout
    assert "kubectl get colocatejobs" in notes

    helm(
        cluster,
        "upgrade",
        "op",
        str(CHART),
        "--namespace",
        namespace,
        "--wait",
        "--timeout",
        "120s",
        "--set",
        "reconcileIntervalSeconds=10",
        "--set",
        "metrics.enabled=false",
    )
    deployment = get_json(cluster, "deployment", "op-colocate-operator", "-n", namespace)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "COLOCATE_RECONCILE_INTERVAL_SECONDS", "value": "10"} in container["env"]
    assert not any(a.startswith("--metrics-port") for a in container["args"])
    history = helm(cluster, "history", "op", "--namespace", namespace, "-o", "json").stdout
    assert [r["revision"] for r in json.loads(history)] == [1, 2]

    helm(cluster, "uninstall", "op", "--namespace", namespace, "--wait", "--timeout", "120s")
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "deployment", "op-colocate-operator", "-n", namespace, check=False
            ).returncode
            != 0
        ),
        60,
        "operator Deployment removed by helm uninstall",
    )
    # CRDs outlive the release (Helm never deletes crds/): jobs are not lost with the operator.
    assert cluster.kubectl("get", "crd", "colocatejobs.colocate.dev", check=False).returncode == 0
