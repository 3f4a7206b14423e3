"""Start, inspect and stop a loopback control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok, seeded with fake GPU nodes that offer both `nvidia.com/gpu` and DRA devices."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from colocate_devcluster import manifests
from colocate_devcluster.binaries import KWOK_STAGES, find_bin_dir
from colocate_devcluster.pki import make_pki
from colocate_devcluster.processes import Component, ComponentError, free_port, http_ok
from colocate_devcluster.realnode import REAL_NODE_LABEL, RealNode, node_name
from colocate_devcluster.supervise import Supervisor

STATE_FILE = "state.json"
# Static pods in a real cluster: restarted when they exit (supervise.py), while this process runs.
SUPERVISED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    workdir: Path
    gpu_nodes: int = 4
    gpus_per_node: int = 8
    bin_dir: Path | None = None
    ready_timeout: float = 180.0  # 2 shared cores: a cold apiserver can need a minute
    verbose: bool = True
    # Appended to kube-apiserver's command line, e.g. an audit policy for benchmarks; later flags win.
    extra_apiserver_args: tuple[str, ...] = ()
    # Appended to kube-controller-manager's command line, e.g. controllers a benchmark turns off.
    extra_controller_manager_args: tuple[str, ...] = ()
    # Feature gates for the apiserver, controller-manager and scheduler, e.g. ("GenericWorkload=true",).
    feature_gates: tuple[str, ...] = ()
    # API group versions the apiserver serves beyond its defaults, e.g. ("scheduling.k8s.io/v1beta1=true",).
    runtime_config: tuple[str, ...] = ()
    # Real nodes beside the kwok ones: kubelet, containerd, runc and CNI on this machine, running images
    # that scripts/build-images.sh built (devcluster/realnode.py; needs root).
    real_nodes: int = 0
    # kwok renews each fake node's Lease every quarter of this, as a kubelet does: 40 s is 400 renewals a
    # second for 4000 nodes, about a core of kube-apiserver's (the scale bench's --node-lease-seconds).
    node_lease_seconds: int = 40

    def __post_init__(self) -> None:
        if self.gpu_nodes < 0 or self.gpus_per_node < 1:
            raise ClusterError(
                f"need gpu_nodes >= 0 and gpus_per_node >= 1, got {self.gpu_nodes}, {self.gpus_per_node}"
            )
        bad = [g for g in self.feature_gates if not re.fullmatch(r"[A-Za-z0-9]+=(true|false)", g)]
        if bad:
            raise ClusterError(f"feature gates must read Name=true or Name=false, got {bad}")

    @property
    def gate_args(self) -> tuple[str, ...]:
        return (f"--feature-gates={','.join(self.feature_gates)}",) if self.feature_gates else ()


# Native gang scheduling (Kubernetes 1.37): the Workload and PodGroup API (scheduling.k8s.io/v1beta1, a beta
# API the apiserver serves only when asked) and the scheduler's GangScheduling plugin, both behind
# GenericWorkload, off by default in 1.37.
GANG_SCHEDULING = {
    "feature_gates": ("GenericWorkload=true",),
    "runtime_config": ("scheduling.k8s.io/v1beta1=true",),
}


@dataclass
class Cluster:
    spec: ClusterSpec
    bin_dir: Path = field(init=False)
    components: list[Component] = field(default_factory=list)
    real_nodes: list[RealNode] = field(default_factory=list)
    server: str = ""
    token: str = ""
    # How to tell that a restarted component serves again (only components something waits on).
    _ready: dict[str, Callable[[], bool]] = field(default_factory=dict, repr=False)
    _node_tokens: dict[int, str] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    supervisor: Supervisor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bin_dir = find_bin_dir(self.spec.bin_dir)

    # -- paths -----------------------------------------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        return self.spec.workdir

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start every component and wait until the cluster schedules pods. On any failure, every process
        started so far is stopped before the error propagates."""
        if (self.workdir / STATE_FILE).exists() and Cluster.load(self.workdir).any_alive():
            raise ClusterError(
                f"a cluster from {self.workdir} is still running; stop it with `devcluster down`"
            )
        started = time.monotonic()
        try:
            self._start_components()
            self._seed()
            self._start_real_nodes()
        except BaseException:
            self.stop()
            raise
        supervised = [c for c in self.components if c.name in SUPERVISED]
        self.supervisor = Supervisor(supervised, self._lock, self._say, lambda _: self._write_state()).start()
        self._say(f"cluster ready in {time.monotonic() - started:.1f} s; KUBECONFIG={self.kubeconfig}")
        return self

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for node in reversed(self.real_nodes):
            node.teardown()
        for component in reversed(self.components):
            component.stop()
        state = self.workdir / STATE_FILE
        if state.exists():
            state.unlink()

    def stop_component(self, name: str) -> None:
        """Stop one component (SIGTERM, then SIGKILL): every client's connections and watches to it break.
        `start_component` brings it back; only in the process that started the cluster (a loaded one does
        not know the command lines)."""
        with self._lock:
            self._own(name).stop()
        self._say(f"stopped {name}")

    def start_component(self, name: str) -> None:
        """Start a stopped component again with the same command line (same ports, same data, as after a
        crash or an in-place upgrade) and wait until it serves (the apiserver: /readyz)."""
        with self._lock:
            component = self._own(name)
            if component.alive():
                raise ClusterError(f"{name} is running; stop it first")
            self._say(f"starting {name} again")
            component.start()
            self._write_state()
        if name in self._ready:
            component.wait_until(self._ready[name], self.spec.ready_timeout, "ready after a restart")

    def restart(self, name: str, down_seconds: float = 0.0) -> None:
        self.stop_component(name)
        time.sleep(down_seconds)
        self.start_component(name)

    def _own(self, name: str) -> Component:
        component = next((c for c in self.components if c.name == name), None)
        if component is None or not component.argv:
            raise ClusterError(f"no component {name!r} started by this process; have {self.status()}")
        return component

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def any_alive(self) -> bool:
        return any(c.alive() for c in self.components)

    def status(self) -> dict[str, bool]:
        return {c.name: c.alive() for c in self.components}

    @classmethod
    def load(cls, workdir: Path) -> Cluster:
        """The cluster a previous `up` left running, from its state file (for `down` and `status`)."""
        state = json.loads((workdir / STATE_FILE).read_text())
        cluster = cls(ClusterSpec(workdir=workdir, bin_dir=Path(state["bin_dir"]), verbose=False))
        cluster.server, cluster.token = state["server"], state["token"]
        cluster.components = [
            Component(c["name"], [], Path(c["log"]), pid=c["pid"]) for c in state["components"]
        ]
        for index in state.get("real_nodes", []):
            node = cluster._real_node(index, token="")
            node.components = [c for c in cluster.components if c.name.endswith(f"-{node.name}")]
            cluster.real_nodes.append(node)
        return cluster

    # -- kubectl ---------------------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def apply(self, objects: list[dict]) -> None:
        self.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )

    # -- internals -------------------------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        if self.spec.verbose:
            print(f"[devcluster] {message}", file=sys.stderr, flush=True)

    def _component(self, name: str, *args: str) -> Component:
        component = Component(name, [str(self.bin_dir / name), *args], self.log_dir / f"{name}.log")
        self._say(f"starting {name} (log: {component.log_path})")
        component.start()
        self.components.append(component)
        self._write_state()
        return component

    def _write_state(self) -> None:
        state = {
            "bin_dir": str(self.bin_dir),
            "server": self.server,
            "token": self.token,
            "kubeconfig": str(self.kubeconfig),
            "components": [{"name": c.name, "pid": c.pid, "log": str(c.log_path)} for c in self.components],
            "real_nodes": [n.index for n in self.real_nodes],
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2))

    def _start_components(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = make_pki(self.workdir / "pki")
        timeout = self.spec.ready_timeout

        etcd_port, peer_port = free_port(), free_port()
        etcd = self._component(
            "etcd",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        )
        etcd.wait_until(lambda: http_ok(f"http://127.0.0.1:{etcd_port}/health"), timeout, "healthy")

        self.token = secrets.token_hex(16)
        tokens = [f'{self.token},admin,admin,"system:masters"']
        self._node_tokens = {i: secrets.token_hex(16) for i in range(self.spec.real_nodes)}
        for i, token in self._node_tokens.items():
            name = node_name(i)
            tokens.append(f"{token},system:node:{name},system:node:{name},system:nodes")
        (self.workdir / "tokens.csv").write_text("\n".join(tokens) + "\n")
        api_port = free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        apiserver = self._component(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # it refuses loopback addresses; nothing in-cluster needs them
            f"--secure-port={api_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--profiling=false",
            # A real node's kubelet reports its name and its IP; only the IP resolves here.
            *(("--kubelet-preferred-address-types=InternalIP,Hostname",) if self.spec.real_nodes else ()),
            *self.spec.gate_args,
            *(
                (f"--runtime-config={','.join(self.spec.runtime_config)}",)
                if self.spec.runtime_config
                else ()
            ),
            *self.spec.extra_apiserver_args,
        )
        self._ready["kube-apiserver"] = lambda: http_ok(
            f"{self.server}/readyz", token=self.token, ca=pki.ca_cert
        )
        apiserver.wait_until(self._ready["kube-apiserver"], timeout, "ready")
        self.kubeconfig.write_text(yaml.safe_dump(manifests.kubeconfig(self.server, pki.ca_cert, self.token)))
        self._write_state()

        kcm_port, sched_port, kwok_port = free_port(), free_port(), free_port()
        kcm = self._component(
            "kube-controller-manager",
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            f"--root-ca-file={pki.ca_cert}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            "--profiling=false",
            *self.spec.gate_args,
            *self.spec.extra_controller_manager_args,
        )
        scheduler = self._component(
            "kube-scheduler",
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={sched_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            "--profiling=false",
            *self.spec.gate_args,
        )
        self._component(
            "kwok",
            f"--kubeconfig={self.kubeconfig}",
            f"--config={self.bin_dir / KWOK_STAGES}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={'='.join(manifests.KWOK_ANNOTATION)}",
            "--cidr=10.244.0.0/16",  # kwok's default pod CIDR would clash with common service ranges
            "--node-ip=10.240.0.1",
            f"--node-lease-duration-seconds={self.spec.node_lease_seconds}",
            f"--server-address=127.0.0.1:{kwok_port}",
        )
        kcm.wait_until(lambda: http_ok(f"https://127.0.0.1:{kcm_port}/healthz"), timeout, "healthy")
        scheduler.wait_until(lambda: http_ok(f"https://127.0.0.1:{sched_port}/healthz"), timeout, "healthy")

    def _seed(self) -> None:
        self._say(f"creating {self.spec.gpu_nodes} fake GPU nodes with {self.spec.gpus_per_node} GPUs each")
        self.apply(manifests.seed_objects(self.spec.gpu_nodes, self.spec.gpus_per_node))
        self._wait(self._nodes_ready, "fake nodes Ready (kwok)")
        # The controller-manager creates each namespace's default ServiceAccount; pods are refused before.
        self._wait(
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0
            ),
            "default ServiceAccount created (kube-controller-manager)",
        )

    def _real_node(self, index: int, token: str) -> RealNode:
        return RealNode(
            index=index,
            workdir=self.workdir,
            bin_dir=self.bin_dir,
            server=self.server,
            ca_cert=self.workdir / "pki" / "ca.crt",
            token=token,
            say=self._say,
        )

    def _start_real_nodes(self) -> None:
        if not self.spec.real_nodes:
            return
        started = time.monotonic()
        for index, token in self._node_tokens.items():
            name = node_name(index)
            # The kubelet's user gets what the Node authorizer would give it (this cluster runs RBAC only).
            self.apply([manifests.node_role_binding(name)])
            node = self._real_node(index, token)
            self.real_nodes.append(node)
            self._write_state()
            try:
                node.start()
            finally:
                self.components.extend(node.components)
                self._write_state()
        self._wait(self._real_nodes_ready, f"{self.spec.real_nodes} real node(s) Ready (kubelet)")
        self._say(f"{self.spec.real_nodes} real node(s) Ready in {time.monotonic() - started:.1f} s")

    def _real_nodes_ready(self) -> bool:
        nodes = json.loads(
            self.kubectl("get", "nodes", "-l", f"{REAL_NODE_LABEL}=true", "-o", "json").stdout
        )["items"]
        ready = [
            n
            for n in nodes
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) >= self.spec.real_nodes

    def _nodes_ready(self) -> bool:
        nodes = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        expected = self.spec.gpu_nodes + 1
        ready = [
            n
            for n in nodes
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len(ready) >= expected

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout
        while time.monotonic() < deadline:
            for component in self.components:
                if not component.alive():
                    raise component.explain_death()
            if ready():
                return
            time.sleep(0.5)
        raise ClusterError(
            f"timed out after {self.spec.ready_timeout:.0f} s waiting for {what}; logs in {self.log_dir}"
        )


__all__ = ["GANG_SCHEDULING", "Cluster", "ClusterError", "ClusterSpec", "ComponentError"]
