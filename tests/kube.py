"""Small helpers for integration tests against the local control plane, and the chart's own identity for
the operator: its ServiceAccount and RBAC rendered by real `helm template`, a TokenRequest token for it."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from colocate_devcluster import Cluster
from colocate_devcluster.localredis import RedisServer

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "colocate-operator"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
# The apiserver's words when RBAC refuses a request, and kopf's when it falls back for lack of a permission.
FORBIDDEN_MARKS = ("403 Forbidden", "is forbidden:", "Not enough permissions")
# Also a 403, but admission refusing the object (Pod Security, a quota), not RBAC refusing the operator.
NOT_RBAC_MARKS = ("violates PodSecurity", "exceeded quota")


def get_json(cluster: Cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def wait_for(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll until probe() returns something truthy; fail with `what` and the last value after timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last value: {last!r}")


def metastore_secret(cluster: Cluster, namespace: str, server: RedisServer, name: str = "ms") -> None:
    """The Secret `name` in `namespace` with `server`'s password (key `password`), as a job's
    `metaStore.external.passwordSecretRef` names it."""
    cluster.kubectl(
        "create", "secret", "generic", name, "-n", namespace, f"--from-literal=password={server.password}"
    )


def external_metastore(server: RedisServer, secret: str = "ms") -> dict[str, Any]:
    """A job's `spec.metaStore` for the test's own Redis `server`, its password in Secret `secret`."""
    return {"mode": "External", "external": {"address": server.addr, "passwordSecretRef": {"name": secret}}}


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


def render_chart(
    cluster: Cluster, *values: str, namespace: str = "colocate-system", release: str = "rel"
) -> list[dict]:
    out = helm(cluster, "template", release, str(CHART), "--namespace", namespace, *values).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@dataclass(frozen=True)
class ChartIdentity:
    """How the chart runs the operator: its ServiceAccount's kubeconfig and the container's plain env."""

    service_account: str
    kubeconfig: Path
    env: dict[str, str]


def chart_identity(
    cluster: Cluster,
    watch_namespace: str,
    workdir: Path,
    *values: str,
    operator_namespace: str = "colocate-system",
    release: str = "colocate-test",
) -> ChartIdentity:
    """Apply the chart's ServiceAccount and RBAC (watching only `watch_namespace`, as `helm install` would
    with watchNamespaces) and return a kubeconfig holding a TokenRequest token of that ServiceAccount.

    The operator started with it can do exactly what the chart grants: a verb the chart lacks is a 403."""
    cluster.kubectl("create", "namespace", operator_namespace, check=False)  # shared by every test
    docs = render_chart(
        cluster,
        "--set",
        f"watchNamespaces={{{watch_namespace}}}",
        *values,
        namespace=operator_namespace,
        release=release,
    )
    cluster.apply([d for d in docs if d["kind"] in RBAC_KINDS])
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
    account = pod["serviceAccountName"]
    token = cluster.kubectl(
        "create", "token", account, "-n", operator_namespace, "--duration=2h"
    ).stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = account
    kubeconfig = workdir / f"{account}.kubeconfig"
    kubeconfig.touch(mode=0o600)
    kubeconfig.write_text(yaml.safe_dump(config))
    return ChartIdentity(f"system:serviceaccount:{operator_namespace}:{account}", kubeconfig, env)


def forbidden_lines(log: str) -> list[str]:
    """Lines of an operator log saying a request was refused for lack of a permission."""
    found = []
    for line in log.splitlines():
        if any(mark in line for mark in NOT_RBAC_MARKS):
            continue
        at = min((i for i in (line.find(mark) for mark in FORBIDDEN_MARKS) if i >= 0), default=-1)
        if at >= 0:
            found.append(line[max(0, at - 100) : at + 300])
    return found
