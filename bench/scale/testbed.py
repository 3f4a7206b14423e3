"""The shared testbed: one local control plane with N fake 8-GPU nodes, an audit log of the operators' own
requests, a service account (and kubeconfig) per operator, and both operators' CRDs.

Nodes and ResourceSlices are created by this harness in parallel batches rather than by the devcluster's one
`kubectl apply` (which reads each object before writing it): 1000 nodes take seconds this way.

kube-controller-manager allows fake nodes 10 minutes without a heartbeat (default 50 s). kwok renews 1000
node leases; when the shared 2-core machine is saturated, the controller-manager's lease informer lags, it
takes healthy fake nodes for unresponsive ones and marks their pods NotReady, and kwok never makes a Running
pod Ready again (no kubelet does). Seen at 250 jobs: 68 jobs stayed Pending with all their pods Running.
(Turning the node-lifecycle controller off is no way out: it also lifts the not-ready taint new nodes get.)
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.scale.kubeapi import Api, ApiError
from bench.scale.source import OperatorSource, snapshot
from bench.scale.workloads import METASTORE_SECRET
from colocate_devcluster import Cluster, ClusterSpec, manifests
from colocate_devcluster.localredis import RedisServer

ROOT = Path(__file__).resolve().parents[2]
KUBERAY_CRDS = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml")
BENCH_NAMESPACE = "colocate-bench"
OPERATOR_ACCOUNTS = {"colocate": "colocate-operator", "kuberay": "kuberay-operator"}
PODS_PER_CPU_NODE = 100  # kwok nodes offer 110 pods; keep some room
LIFECYCLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
NODES_TIMEOUT = 600.0
NODE_LEASE_MAX_SECONDS = 300  # well inside --node-monitor-grace-period=10m below


def username(operator: str) -> str:
    return f"system:serviceaccount:{BENCH_NAMESPACE}:{OPERATOR_ACCOUNTS[operator]}"


def audit_policy() -> dict[str, Any]:
    """The operators' requests, once each (when the response is complete), metadata only; and the writes
    the controller-manager makes because of their objects (audit.CONTROLLER_RESOURCES: a PodDisruptionBudget's
    status, a Service's EndpointSlices), which only it writes here."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted"],
        "rules": [
            {"level": "Metadata", "users": [username(op) for op in OPERATOR_ACCOUNTS]},
            {
                "level": "Metadata",
                "verbs": ["create", "update", "patch", "delete"],
                "resources": [
                    {"group": "policy", "resources": ["poddisruptionbudgets/status"]},
                    {"group": "discovery.k8s.io", "resources": ["endpointslices"]},
                    {"group": "", "resources": ["endpoints"]},
                ],
            },
            {"level": "None"},
        ],
    }


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Testbed:
    __test__ = False  # not a pytest test class, despite the name

    workdir: Path
    gpu_nodes: int
    cpu_nodes: int
    bin_dir: Path | None = None
    kuberay_crd_dir: Path | None = None
    with_redis: bool = False  # for the step-event runs
    node_lease_seconds: int = 40  # kwok renews each node's Lease every quarter of it (ClusterSpec)
    source: OperatorSource = field(default_factory=lambda: snapshot("worktree", Path()))
    cluster: Cluster = field(init=False)
    redis: RedisServer | None = None
    api: Api = field(init=False)
    kubeconfigs: dict[str, Path] = field(default_factory=dict)

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def start(self) -> Testbed:
        if not 10 <= self.node_lease_seconds <= NODE_LEASE_MAX_SECONDS:
            raise ValueError(
                f"node_lease_seconds must be 10-{NODE_LEASE_MAX_SECONDS} (the controller-manager's node "
                f"monitor grace period here is 10 minutes), not {self.node_lease_seconds}"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(audit_policy()))
        spec = ClusterSpec(
            workdir=self.workdir,
            gpu_nodes=0,  # seeded below, in parallel
            bin_dir=self.bin_dir,
            ready_timeout=300,
            node_lease_seconds=self.node_lease_seconds,
            extra_apiserver_args=(
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=0",
            ),
            # The controller-manager's default 20 requests/s lift the not-ready taints of 1000 new nodes at
            # about 4.5 nodes/s; more lets the runs start sooner (they wait for it either way).
            extra_controller_manager_args=(
                "--node-monitor-grace-period=10m",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ),
        )
        self.cluster = Cluster(spec)
        self.cluster.start()
        try:
            self.api = Api.from_kubeconfig(self.cluster.kubeconfig)
            self._seed_nodes()
            self._accounts()
            self._crds()
            if self.with_redis:
                self.redis = RedisServer(self.workdir / "redis").start(timeout_s=20)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()
        self.cluster.stop()

    def metastore_secret(self, namespace: str) -> None:
        """The Secret an External meta-store job names (METASTORE_SECRET, key "password")."""
        assert self.redis is not None
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": METASTORE_SECRET},
            "stringData": {"password": self.redis.password},
        }
        self.api.create(f"/api/v1/namespaces/{namespace}/secrets", body)

    # -- nodes -----------------------------------------------------------------------------------------------
    def _seed_nodes(self) -> None:
        started = time.monotonic()
        gpu = manifests.fake_nodes(self.gpu_nodes, 8, cpu_nodes=self.cpu_nodes)
        slices = [manifests.resource_slice(manifests.gpu_node_name(i), 8) for i in range(self.gpu_nodes)]
        say(
            f"creating {self.gpu_nodes} GPU nodes (8 GPUs each), their ResourceSlices and {self.cpu_nodes} "
            "CPU nodes"
        )

        def create(body: dict[str, Any]) -> None:
            path = "/api/v1/nodes" if body["kind"] == "Node" else "/apis/resource.k8s.io/v1/resourceslices"
            try:
                self.api.create(path, body)
            except ApiError as e:
                if e.status != 409:  # cpu-node-0 exists already
                    raise

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(create, [*gpu, *slices]))
        expected = self.gpu_nodes + self.cpu_nodes
        deadline = time.monotonic() + NODES_TIMEOUT
        ready = 0
        schedulable = 0
        while time.monotonic() < deadline:
            nodes = self.api.get("/api/v1/nodes")["items"]
            ready = sum(1 for n in nodes if _is_ready(n))
            schedulable = sum(1 for n in nodes if _is_ready(n) and not _lifecycle_taints(n))
            if schedulable >= expected:
                say(f"{ready} nodes Ready and schedulable in {time.monotonic() - started:.1f} s")
                return
            time.sleep(2)
        raise TimeoutError(
            f"{ready} of {expected} nodes Ready, {schedulable} without a not-ready taint after "
            f"{NODES_TIMEOUT:.0f} s"
        )

    # -- identities ------------------------------------------------------------------------------------------
    def _accounts(self) -> None:
        """A service account per operator, bound to cluster-admin (the same rights for both), and a
        kubeconfig with its token: the audit log tells the two operators (and everything else) apart."""
        self.api.create("/api/v1/namespaces", _namespace(BENCH_NAMESPACE))
        ca = self.api.ca_file
        for operator, account in OPERATOR_ACCOUNTS.items():
            base = f"/api/v1/namespaces/{BENCH_NAMESPACE}/serviceaccounts"
            self.api.create(
                base, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}}
            )
            self.api.create(
                "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": f"bench-{account}"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "cluster-admin",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": BENCH_NAMESPACE}],
                },
            )
            request = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 12 * 3600},
            }
            token = self.api.create(f"{base}/{account}/token", request)["status"]["token"]
            path = self.workdir / f"kubeconfig-{operator}"
            path.write_text(yaml.safe_dump(manifests.kubeconfig(self.api.server, ca, token, user=account)))
            self.kubeconfigs[operator] = path

    def _crds(self) -> None:
        files = [self.source.crd]
        if self.kuberay_crd_dir is not None:
            files += [self.kuberay_crd_dir / name for name in KUBERAY_CRDS]
        for path in files:
            self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in files]
        # Polled, not `kubectl wait`: that fails at once while a new CRD's conditions are still null.
        established = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + 120
        for name in names:
            while (
                self.cluster.kubectl(
                    "get", f"crd/{name}", "-o", f"jsonpath={established}", check=False
                ).stdout
                != "True"
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"CRD {name} not Established after 120 s")
                time.sleep(0.2)

    # -- namespaces ------------------------------------------------------------------------------------------
    def create_namespace(self, name: str) -> None:
        self.api.create("/api/v1/namespaces", _namespace(name))
        deadline = time.monotonic() + 60  # pods are refused until the default ServiceAccount exists
        while time.monotonic() < deadline:
            try:
                self.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
                return
            except ApiError:
                time.sleep(0.5)
        raise TimeoutError(f"namespace {name}: no default ServiceAccount after 60 s")

    def wait_listable(self, path: str, timeout: float = 60) -> None:
        """A CRD's storage answers 429 for a while after it was (re)initialised; wait it out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api.get(path)
                return
            except ApiError as e:
                if e.status != 429 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def delete_namespace(self, name: str, crd_plural: str, crd_group: str, timeout: float = 300) -> float:
        """Remove every pod at once (no operator runs any more), then the namespace; seconds it took."""
        started = time.monotonic()
        self.cluster.kubectl(
            "delete",
            "pods",
            "--all",
            "-n",
            name,
            "--force",
            "--grace-period=0",
            "--wait=false",
            check=False,
            timeout=180,
        )
        self.api.delete(f"/api/v1/namespaces/{name}")
        deadline = started + timeout
        while time.monotonic() < deadline:
            try:
                self.api.get(f"/api/v1/namespaces/{name}")
            except ApiError as e:
                if e.status == 404:
                    return time.monotonic() - started
                raise
            self._drop_finalizers(name, crd_plural, crd_group)
            time.sleep(2)
        raise TimeoutError(f"namespace {name} still exists after {timeout:.0f} s")

    def _drop_finalizers(self, namespace: str, plural: str, group: str) -> None:
        """With the operator stopped nobody removes its finalizers; the namespace would never go."""
        try:
            items = self.api.get(f"/apis/{group}/namespaces/{namespace}/{plural}")["items"]
        except ApiError:
            return
        for item in items:
            if item["metadata"].get("finalizers"):
                path = f"/apis/{group}/namespaces/{namespace}/{plural}/{item['metadata']['name']}"
                with contextlib.suppress(ApiError):
                    self.api.merge_patch(path, {"metadata": {"finalizers": None}})

    def drained(self, timeout: float = 120) -> bool:
        """Whether no pod is left anywhere within `timeout`: the operators run as local processes, so every
        pod is a run's, and one still bound would hold a node the next run's jobs need (a 1000-job run's
        teardown left some; the next operator then measured a smaller cluster)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.api.get("/api/v1/pods", limit="1")["items"]:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(2)

    def pid_of(self, component: str) -> int | None:
        return next((c.pid for c in self.cluster.components if c.name == component), None)


def _namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _lifecycle_taints(node: dict[str, Any]) -> list[str]:
    """Taints the node-lifecycle controller puts on every new node and lifts, node by node, once it has seen
    the node Ready: until then the scheduler rejects every pod there."""
    taints = (node.get("spec") or {}).get("taints") or []
    return [t["key"] for t in taints if t.get("key") in LIFECYCLE_TAINTS]


def _is_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def cpu_nodes_for(max_jobs: int) -> int:
    """Our meta-store pods (one per job) need untainted nodes."""
    return max(1, math.ceil((max_jobs + 10) / PODS_PER_CPU_NODE))
