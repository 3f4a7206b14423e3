"""Fixtures shared by every test directory: one real local control plane for all integration tests, and a
real redis-server (colocate_devcluster.localredis, the launcher the benches and the demo use too)."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator

import pytest

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.localredis import RedisServer, redis_binary


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok, with 4 fake GPU nodes of 8
    GPUs (extended resource and DRA devices) and one CPU node. KUBECONFIG points at it for the session."""
    workdir = tmp_path_factory.mktemp("devcluster")
    cluster = Cluster(
        ClusterSpec(
            workdir=workdir,
            gpu_nodes=4,
            gpus_per_node=8,
            # On in OpenShift and hardened clusters: setting blockOwnerDeletion needs the owner's finalizers
            # (the chart must grant colocatejobs/finalizers, and the operator runs under the chart's RBAC).
            extra_apiserver_args=("--enable-admission-plugins=OwnerReferencesPermissionEnforcement",),
        )
    )
    cluster.start()
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        print(f"\n[devcluster] component logs kept in {cluster.log_dir}", file=sys.stderr)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"t-{secrets.token_hex(4)}"
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def _started_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found (install Debian's redis-server or set COLOCATE_REDIS_SERVER)")
    server = RedisServer(tmp_path_factory.mktemp("redis"), binary).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server per test: free 127.0.0.1 port, a password, no persistence, killed at teardown."""
    with _started_redis(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for a module's tests (those that share a slow-to-start peer, such as real SGLang)."""
    with _started_redis(tmp_path_factory) as server:
        yield server
