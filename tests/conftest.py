"""Fixtures shared by every test directory: one real local control plane for all integration tests, and a
real redis-server (colocate_devcluster.localredis, the launcher the benches and the demo use too).

Under pytest-xdist (`make test` runs `-n 2 --dist loadscope`) each worker is its own process with its own
session fixtures (its own control plane); a module is the unit a worker takes, so a module-scoped server
(real SGLang, Redis) still starts once. The scheduler below runs the CPU-bound modules on one worker, one
after another, beside the tests that wait on processes; keeps tests/realnode (host-wide state) on one
worker; and deals the costliest out first so neither worker is left alone with one at the end."""

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


# Modules that must share one worker: their session fixture owns host-wide state (a kubelet, containerd
# and CNI bridge per machine).
ONE_WORKER = ("tests/realnode/",)
# The CPU-bound ones (real SGLang servers, torchrun + megatron-core, the demos): one scope on one worker, run
# one after another while the other worker takes the tests that mostly wait on a control plane. Two of them
# at once on two cores (each SGLang rank binds its OpenMP threads to a core) take several times as long and
# run into their step timeouts; the whole group, dealt out first, is about 13 of the suite's 30 minutes.
CPU_BOUND = (
    "tests/test_demo_megatron.py",
    "tests/sglang_real/",
    "tests/megatron_real/",
    "tests/test_demo_engine_recovery.py",
    "tests/test_demo.py",
)
# Then the costliest of the rest (--durations of a clean-clone run, 2026-12-03): a scope that starts last and
# runs for a minute is what leaves one worker idle at the end.
HEAVY_NEXT = (
    "tests/test_dockerfile.py",
    "tests/realnode/",
    "tests/operator/test_apiserver_restart_integration.py",
    "tests/operator/test_integration.py",
    "tests/operator/test_metastore_loss_integration.py",
    "tests/bench/test_scale_smoke.py",
)
CPU_SCOPE = "cpu-bound: " + " ".join(CPU_BOUND)


def _rank(nodeid: str) -> int:
    order = (*CPU_BOUND, *HEAVY_NEXT)
    return next((i for i, prefix in enumerate(order) if nodeid.startswith(prefix)), len(order))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist only: the CPU-bound group first, then the heaviest of the rest (a stable sort: each
    module's own order is kept)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent from a venv without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadscope with CPU_BOUND as one scope and each ONE_WORKER directory as one, in the order
    above instead of xdist's reorder by test count."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(CPU_BOUND):
                return CPU_SCOPE
            shared = next((d for d in ONE_WORKER if nodeid.startswith(d)), None)
            return shared or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return Scheduling(config, log)
