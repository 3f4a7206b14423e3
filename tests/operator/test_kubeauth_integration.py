"""The operator's own API client without the kubernetes client library (kubeauth.py, kube.py): its
credentials come from kopf's login functions, a 401 logs in again once, and `python -m colocate_operator`
keeps the library out of the process unless the kubeconfig's user needs one of its plugins."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from colocate_devcluster import Cluster
from colocate_operator import kube, kubeauth

pytestmark = pytest.mark.integration

PROBE = (
    "import sys; import colocate_operator.__main__; "
    "print('kubernetes' if sys.modules.get('kubernetes') is not None else 'kept out')"
)


def _with_user(kubeconfig: Path, tmp_path: Path, user: dict) -> Path:
    doc = yaml.safe_load(kubeconfig.read_text())
    for entry in doc["users"]:
        entry["user"] = user
    out = tmp_path / "kubeconfig"
    out.write_text(yaml.safe_dump(doc))
    return out


def _probe(kubeconfig: Path) -> str:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()


def test_the_client_reads_and_writes_with_kopfs_credentials(cluster: Cluster, namespace: str) -> None:
    api = kube.Kube.from_environment()
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}, "data": {"a": "1"}}
    version = api.create(kube.Kind("v1", "configmaps"), namespace, body)
    got = api.get(kube.Kind("v1", "configmaps"), namespace, "probe")
    assert got is not None and got["data"] == {"a": "1"} and got["metadata"]["resourceVersion"] == version
    with pytest.raises(kube.KubeError) as err:
        api.create(kube.Kind("v1", "configmaps"), namespace, body)
    assert err.value.status == 409 and err.value.reason == "AlreadyExists"


def test_a_401_logs_in_again_once(cluster: Cluster, namespace: str) -> None:
    logins = []

    def login():  # the first token is refused (as a rotated one would be), the next is the real one
        info = kubeauth.login()
        logins.append(info)
        return info if len(logins) > 1 else dataclasses.replace(info, token="not-a-token")

    api = kube.Kube.from_login(login)
    assert api.list(kube.PODS, namespace) == [] and len(logins) == 2

    def always_wrong():
        logins.append(None)
        return dataclasses.replace(kubeauth.login(), token="not-a-token")

    with pytest.raises(kube.KubeError) as err:
        kube.Kube.from_login(always_wrong).list(kube.PODS, namespace)
    assert err.value.status == 401 and logins.count(None) == 2  # once more, then the error


def test_the_library_stays_out_unless_a_plugin_user_needs_it(cluster: Cluster, tmp_path: Path) -> None:
    assert _probe(cluster.kubeconfig) == "kept out"  # a token user: kopf's own login reads it
    plugin = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true"}}
    assert _probe(_with_user(cluster.kubeconfig, tmp_path, plugin)) == "kubernetes"


def test_which_kubeconfig_users_need_the_library() -> None:
    def doc(user: dict) -> dict:
        return {
            "current-context": "c",
            "contexts": [{"name": "c", "context": {"user": "u", "cluster": "k"}}],
            "users": [{"name": "u", "user": user}, {"name": "other", "user": {"exec": {"command": "x"}}}],
        }

    assert not kubeauth.kubeconfig_needs_client_library([doc({"token": "t"})])
    assert not kubeauth.kubeconfig_needs_client_library([doc({"client-certificate-data": "x"})])
    assert kubeauth.kubeconfig_needs_client_library([doc({"exec": {"command": "aws"}})])
    assert kubeauth.kubeconfig_needs_client_library([doc({"auth-provider": {"name": "oidc"}})])
    assert not kubeauth.kubeconfig_needs_client_library([])
