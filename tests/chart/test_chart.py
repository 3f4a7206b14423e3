"""The Helm chart: lint, render for several value sets, validate against the real API server, and install,
upgrade and uninstall on the local control plane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from tests.kube import CHART, get_json, helm, render_chart, wait_for

ROOT = Path(__file__).resolve().parents[2]

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "cluster-wide": ["--set", "rbac.clusterWide=true"],
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


def render(cluster: Cluster, *values: str, namespace: str = "colocate-system") -> list[dict]:
    return render_chart(cluster, *values, namespace=namespace)


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


READ_VERBS = {"get", "list", "watch"}


def operator_roles(docs: list[dict]) -> list[dict]:
    """The Roles holding the operator's rules (not the leader-election Role of its own namespace)."""
    return [r for r in by_kind(docs, "Role") if ("", "pods") in grants(r)]


def namespace_args(docs: list[dict]) -> list[str]:
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if a.startswith("--namespace")]


@pytest.mark.integration
def test_rbac_is_namespaced_by_default_and_cluster_wide_only_when_asked(cluster: Cluster) -> None:
    # Default: the release's namespace only; nothing cluster-wide but reads (issue 30, item 9).
    default = render(cluster)
    assert {
        verb for role in by_kind(default, "ClusterRole") for r in role["rules"] for verb in r["verbs"]
    } <= (READ_VERBS)
    assert [r["metadata"]["namespace"] for r in operator_roles(default)] == ["colocate-system"]
    (binding,) = [
        b for b in by_kind(default, "RoleBinding") if b["roleRef"]["name"] == "rel-colocate-operator"
    ]
    assert binding["metadata"]["namespace"] == "colocate-system"
    assert namespace_args(default) == ["--namespace=colocate-system"]
    # Listed namespaces: a Role in each, the operator watching exactly those.
    narrow = render(cluster, *VALUE_SETS["namespaced"])
    (discovery,) = by_kind(narrow, "ClusterRole")
    assert {verb for rule in discovery["rules"] for verb in rule["verbs"]} == READ_VERBS
    assert sorted(r["metadata"]["namespace"] for r in operator_roles(narrow)) == ["team-a", "team-b"]
    assert namespace_args(narrow) == ["--namespace=team-a", "--namespace=team-b"]
    assert not any("secrets" in rule.get("resources", []) for rule in discovery["rules"])
    # rbac.clusterWide: the operator's rules in a ClusterRole, every namespace watched.
    wide = render(cluster, *VALUE_SETS["cluster-wide"])
    roles = {r["metadata"]["name"]: r for r in by_kind(wide, "ClusterRole")}
    assert set(roles) == {"rel-colocate-operator", "rel-colocate-operator-discovery"}
    assert grants(roles["rel-colocate-operator"]) == OPERATOR_RULES
    assert not operator_roles(wide) and namespace_args(wide) == []
    # Both at once is a contradiction, refused naming the values.
    both_values = ["--set", "rbac.clusterWide=true", "--set", "watchNamespaces={a}"]
    both = helm(cluster, "template", "rel", str(CHART), *both_values, check=False)
    assert both.returncode != 0 and "rbac.clusterWide" in both.stderr and "watchNamespaces" in both.stderr


@pytest.mark.integration
def test_metrics_are_open_only_to_the_listed_peers(cluster: Cluster) -> None:
    (policy,) = by_kind(render(cluster), "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "colocate-operator",
        "app.kubernetes.io/instance": "rel",
    }
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    health, metrics = policy["spec"]["ingress"]
    assert health == {"ports": [{"protocol": "TCP", "port": 8080}]}  # probes and `helm test`
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    peers = (
        '[{"namespaceSelector":{"matchLabels":{"team":"obs"}},"podSelector":{"matchLabels":{"app":"prom"}}}]'
    )
    (custom,) = by_kind(render(cluster, "--set-json", f"metrics.allowFrom={peers}"), "NetworkPolicy")
    assert custom["spec"]["ingress"][1]["from"] == json.loads(peers)
    # No metrics port: health alone; no peers: nobody reaches the metrics port.
    for values in (["--set", "metrics.enabled=false"], ["--set-json", "metrics.allowFrom=[]"]):
        (policy,) = by_kind(render(cluster, *values), "NetworkPolicy")
        assert policy["spec"]["ingress"] == [health]
    assert not by_kind(render(cluster, "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


# Every verb the operator uses and nothing more (H2, M1); the integration suite runs the operator under these.
OPERATOR_RULES = {
    ("colocate.dev", "colocatejobs"): {"get", "list", "watch", "delete", "patch"},
    ("colocate.dev", "colocatejobs/status"): {"patch"},
    ("colocate.dev", "colocatejobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "list", "create"},
    ("", "secrets"): {"get", "create"},
    ("", "events"): {"create"},
    ("apps", "deployments"): {"get", "list", "watch", "create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "create"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "create"},
    ("resource.k8s.io", "resourceclaimtemplates"): {"get", "create"},
    ("resource.k8s.io", "resourceclaims"): {"get"},
    ("scheduling.k8s.io", "workloads"): {"get", "create"},
    ("scheduling.k8s.io", "podgroups"): {"get", "create"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch", "create"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


@pytest.mark.integration
def test_rbac_grants_only_the_verbs_the_operator_uses(cluster: Cluster) -> None:
    wide = {
        r["metadata"]["name"]: r for r in by_kind(render(cluster, *VALUE_SETS["cluster-wide"]), "ClusterRole")
    }
    assert grants(wide["rel-colocate-operator"]) == OPERATOR_RULES
    discovery = {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("resource.k8s.io", "deviceclasses"): {"get"},
        ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
        ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    }
    # Cluster-wide, kopf needs no namespaces; watching listed ones, it follows them appearing.
    assert grants(wide["rel-colocate-operator-discovery"]) == discovery
    narrow = render(cluster, *VALUE_SETS["namespaced"])
    (cluster_role,) = by_kind(narrow, "ClusterRole")
    assert grants(cluster_role) == {**discovery, ("", "namespaces"): {"list", "watch"}}
    for role in operator_roles(narrow):
        assert grants(role) == OPERATOR_RULES
    assert not any("*" in verbs for verbs in grants(wide["rel-colocate-operator"]).values())


@pytest.mark.integration
def test_external_metastore_allow_list_reaches_the_operator(cluster: Cluster) -> None:
    def env(*values: str) -> dict[str, str]:
        (deployment,) = by_kind(render(cluster, *values), "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    assert "COLOCATE_EXTERNAL_METASTORE_ALLOW" not in env(), "none by default: External is refused"
    allowed = env("--set", "externalMetaStore.allowedAddresses={redis.shared.example.com:6379,10.20.0.0/16}")
    assert allowed["COLOCATE_EXTERNAL_METASTORE_ALLOW"] == "redis.shared.example.com:6379,10.20.0.0/16"
    bad = helm(
        cluster,
        "template",
        "rel",
        str(CHART),
        "--set",
        "externalMetaStore.allowedAddresses={a b}",
        check=False,
    )
    assert bad.returncode != 0 and "schema" in bad.stderr.lower()


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


@pytest.mark.integration
def test_the_helm_test_pod_does_not_pass_for_the_operator(cluster: Cluster) -> None:
    docs = render(cluster)
    (pod,) = by_kind(docs, "Pod")
    (deployment,) = by_kind(docs, "Deployment")
    operator = deployment["spec"]["selector"]["matchLabels"]
    # Neither the Service nor a meta-store's NetworkPolicy (they select the operator by these) takes it.
    assert not operator.items() <= pod["metadata"]["labels"].items()


@pytest.mark.integration
def test_allow_list_names_must_be_fully_qualified(cluster: Cluster) -> None:
    # What the operator would refuse to start on (addresses.py) is refused at install, naming the entry.
    for short in ("redis:6379", "redis.shared.svc:6379", "*.svc"):
        value = f'externalMetaStore.allowedAddresses=["{short}"]'
        result = helm(cluster, "template", "rel", str(CHART), "--set-json", value, check=False)
        assert result.returncode != 0 and short in result.stderr, result.stderr
        assert "not a fully qualified name" in result.stderr
    fine = (
        '["redis.shared.svc.cluster.local:6379","redis.internal.","*.example.com","10.0.0.0/8","127.0.0.1"]'
    )
    assert helm(
        cluster, "template", "rel", str(CHART), "--set-json", f"externalMetaStore.allowedAddresses={fine}"
    )
