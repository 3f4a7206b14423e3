"""Fixtures shared by every test directory: one real local control plane for all integration tests, and a
real redis-server (colocate_devcluster.localredis, the launcher the benches and the demo use too).

Under pytest-xdist (`make test` runs `-n 2 --dist loadscope`) each worker is its own process with its own
session fixtures (its own control plane); a module is the unit a worker takes, so a module-scoped server
(real SGLang, Redis) still starts once. The scheduler below keeps a directory whose session fixture holds
host-wide state (tests/realnode: one kubelet, containerd and CNI bridge per machine) on one worker, and the
heaviest modules go out first so neither worker is left alone with one at the end."""

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


# Directories whose modules must share one worker: their session fixture owns host-wide state.
ONE_WORKER_DIRS = ("tests/realnode/",)
# The costliest modules of a `make test` run (--durations of a clean-clone run, 2026-12-03), dealt out first:
# a scope that starts last and runs for minutes is what makes two workers finish far apart.
HEAVY_FIRST = (
    "tests/test_demo_megatron.py",
    "tests/sglang_real/test_conformance.py",
    "tests/sglang_real/test_mla.py",
    "tests/sglang_real/test_auto_loader.py",
    "tests/test_dockerfile.py",
    "tests/realnode/",
    "tests/operator/test_apiserver_restart_integration.py",
    "tests/sglang_real/test_serve_api_key.py",
    "tests/megatron_real/",
    "tests/operator/test_integration.py",
    "tests/test_demo_engine_recovery.py",
    "tests/operator/test_metastore_loss_integration.py",
    "tests/bench/test_scale_smoke.py",
    "tests/test_demo.py",
)


def _heavy_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(HEAVY_FIRST) if nodeid.startswith(prefix)), len(HEAVY_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist only: the heaviest modules first (a stable sort: every module's own order is kept)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _heavy_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent from a venv without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadscope, with ONE_WORKER_DIRS one scope each and the collection's order kept (the
    heaviest first, above) instead of xdist's reorder by test count."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            shared = next((d for d in ONE_WORKER_DIRS if nodeid.startswith(d)), None)
            return shared or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return Scheduling(config, log)
