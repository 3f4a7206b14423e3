"""A real node beside the kwok nodes: containerd, runc, the CNI bridge plugin and a kubelet built from the
same Kubernetes module as the control plane. Pods placed on it run real containers from images built here
(scripts/build-images.sh), imported into its containerd; nothing is pulled. Its GPUs come from a fake
device plugin the kubelet talks to (devcluster/fakegpu, a stand-in for NVIDIA's; GPU_RESOURCE below).

Needs root, Debian's containerd, runc and containernetworking-plugins (`can_run` says what is missing).
Everything it makes lives under <workdir>/realnode-<i> and a short-path runtime directory (unix sockets
are limited to 108 bytes), and teardown removes it all: the pods' processes, mounts, network namespaces,
the bridge, the cgroups and the in-cluster route to the apiserver.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from colocate_devcluster.binaries import MissingBinaries, find_fakegpu
from colocate_devcluster.processes import Component, ComponentError, free_port

CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
REAL_NODE_LABEL = "colocate.dev/real-node"
# Only pods that ask for the real node land there (a toleration and, to be sure, a nodeSelector): the kwok
# nodes keep taking everything else. A job meant for it (tests/realnode, `make demo` with --real-node) selects
# and tolerates it; its Redis, which the operator renders without tolerations, gets there once the node's
# taint is removed and the kwok nodes cordoned (`dedicate`).
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
SERVICE_HOST = "10.96.0.1"  # the `kubernetes` Service's ClusterIP (first of --service-cluster-ip-range)
SERVICE_FQDN = "kubernetes.default.svc.cluster.local"
PAUSE_IMAGE = "localhost/pause:colocate"


# GPUs: a fake GPU driver the kubelet really talks to, a STAND-IN for NVIDIA's device plugin with no GPU
# behind it (devcluster/fakegpu, built by scripts/build-tools.sh). It registers `nvidia.com/gpu` through the
# kubelet's plugin watcher and offers GPUS fake devices; the kubelet puts them into the node's capacity and
# allocatable and, for a container that asks for them, calls its Allocate, which sets
# NVIDIA_VISIBLE_DEVICES to the devices' IDs (fake-gpu-0, ...). Containers see no device node (there is
# none), so jobs there use gpu.allocation DevicePlugin (a DRA claim would wait for a driver that is not
# there).
GPU_RESOURCE = "nvidia.com/gpu"
GPUS = 2
GPU_ENV = "NVIDIA_VISIBLE_DEVICES"
GPU_ID_PREFIX = "fake-gpu-"


def dedicate(kubectl: Callable[..., Any], index: int = 0) -> None:
    """Make real node `index` the cluster's only schedulable node, untainted: every pod created from now on,
    the operator's Redis included, runs a real container there. `kubectl` is Cluster.kubectl. The kwok nodes
    are cordoned, not removed (their pods stay)."""
    name = node_name(index)
    others = [n for n in kubectl("get", "nodes", "-o", "name").stdout.split() if n != f"node/{name}"]
    if others:
        kubectl("cordon", *others)
    kubectl("taint", "node", name, f"{REAL_NODE_LABEL}-", check=False)  # already gone: fine


def node_name(index: int) -> str:
    return f"realnode-{index}"


def cni_bin_dir() -> str | None:
    return next((d for d in CNI_BIN_DIRS if os.access(os.path.join(d, "bridge"), os.X_OK)), None)


def can_run() -> str | None:
    """None when this machine can run a real node, else exactly why not."""
    if os.geteuid() != 0:
        return "a real node needs root (containerd, runc, network namespaces, cgroups)"
    missing = [tool for tool in ("containerd", "ctr", "runc", "iptables", "ip") if shutil.which(tool) is None]
    if cni_bin_dir() is None:
        missing.append(f"CNI plugins (bridge, host-local, loopback in {' or '.join(CNI_BIN_DIRS)})")
    if missing:
        return (
            f"a real node needs {', '.join(missing)}: "
            "apt-get install containerd runc containernetworking-plugins iptables iproute2"
        )
    if not Path("/sys/fs/cgroup").is_dir():
        return "a real node needs cgroups mounted at /sys/fs/cgroup"
    return None


def node_ip() -> str:
    """The machine's own first global IPv4 address: the kubelet refuses loopback as its node IP; the
    apiserver reaches the kubelet there (traffic stays on this machine)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True
    )
    for link in json.loads(out.stdout or "[]"):
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                return addr["local"]
    raise ComponentError("no global IPv4 address on this machine for the real node's kubelet")


def images_dir() -> Path:
    root = Path(os.environ.get("COLOCATE_CACHE_DIR", Path.home() / ".cache" / "colocate-operator"))
    return Path(os.environ.get("COLOCATE_IMAGES_DIR", root / "images"))


@dataclass
class RealNode:
    index: int
    workdir: Path  # the cluster's
    bin_dir: Path
    server: str  # https://127.0.0.1:<port>
    ca_cert: Path
    token: str  # the kubelet's bearer token (user system:node:<name>, group system:nodes)
    images: Path = field(default_factory=images_dir)
    say: Callable[[str], None] = print
    components: list[Component] = field(default_factory=list)
    gpus: int = GPUS  # fake devices the node's device plugin offers

    # -- names and paths ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return node_name(self.index)

    @property
    def dir(self) -> Path:
        return self.workdir / self.name

    @property
    def run_dir(self) -> Path:
        """containerd's state and socket: a short path of its own, derived from the node's directory."""
        digest = hashlib.sha256(str(self.dir.resolve()).encode()).hexdigest()[:10]
        return Path("/run/colocate") / f"{self.index}-{digest}"

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def bridge(self) -> str:
        return f"colo{self.index}-{hashlib.sha256(str(self.dir.resolve()).encode()).hexdigest()[:6]}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """10.85.x.0/24, x from the node's directory: two clusters on one machine (two test runs) each get
        their own bridge, subnet, DNS address and cgroup root."""
        octet = (int(hashlib.sha256(str(self.dir.resolve()).encode()).hexdigest()[:8], 16) + self.index) % 256
        return ipaddress.IPv4Network(f"10.85.{octet}.0/24")

    @property
    def plugins_registry(self) -> Path:
        """The kubelet's plugin watcher directory (<root-dir>/plugins_registry): its own, unlike
        /var/lib/kubelet/device-plugins/, which the kubelet hard-codes and empties when it starts."""
        return self.dir / "kubelet" / "plugins_registry"

    @property
    def cgroup_root(self) -> str:
        return f"/colocate-{self.bridge}"

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        why = can_run()
        if why:
            raise ComponentError(why)
        kubelet = self.bin_dir / "kubelet"
        if not os.access(kubelet, os.X_OK):
            raise ComponentError(f"no kubelet in {self.bin_dir}; run `bash scripts/build-tools.sh`")
        try:
            fakegpu = find_fakegpu()
        except MissingBinaries as err:
            raise ComponentError(str(err)) from err
        self.teardown()  # what a killed run left behind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._network()
        self._cgroups()
        started = time.monotonic()
        containerd = Component(
            f"containerd-{self.name}",
            [shutil.which("containerd") or "containerd", f"--config={self._containerd_config()}"],
            self.dir / "containerd.log",
        )
        containerd.start()
        self.components.append(containerd)
        containerd.wait_until(lambda: self._ctr("version", check=False).returncode == 0, timeout, "serving")
        self._import_images()
        self.say(f"{self.name}: containerd up, images imported in {time.monotonic() - started:.1f} s")
        gateway = str(next(self.subnet.hosts()))
        token_file = (
            self.dir / "dns.token"
        )  # the node's token, for the DNS's API reads (not on a command line)
        token_file.touch(mode=0o600)
        token_file.write_text(self.token)
        dns = Component(
            f"dns-{self.name}",
            [
                sys.executable,
                "-m",
                "colocate_devcluster.dns",
                f"--listen={gateway}:53",
                *(f"--record={n}={SERVICE_HOST}" for n in ("kubernetes.default.svc", SERVICE_FQDN)),
                f"--api-server={self.server}",
                f"--ca={self.ca_cert}",
                f"--token-file={token_file}",
            ],
            self.dir / "dns.log",
        )
        dns.start()
        self.components.append(dns)
        node = Component(
            f"kubelet-{self.name}",
            [
                str(kubelet),
                f"--config={self._kubelet_config()}",
                f"--kubeconfig={self._kubeconfig()}",
                f"--root-dir={self.dir / 'kubelet'}",
                f"--cert-dir={self.dir / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={node_ip()}",
                f"--node-labels={REAL_NODE_LABEL}=true",
                "--register-with-taints={key}={value}:{effect}".format(**REAL_NODE_TAINT),
                "--v=1",
            ],
            self.dir / "kubelet.log",
        )
        node.start()
        self.components.append(node)
        self.components.append(
            Component(
                f"fakegpu-{self.name}",
                [
                    str(fakegpu),
                    f"--resource={GPU_RESOURCE}",
                    f"--count={self.gpus}",
                    f"--id-prefix={GPU_ID_PREFIX}",
                    f"--env={GPU_ENV}",
                    f"--registry-dir={self.plugins_registry}",
                ],
                self.dir / "fakegpu.log",
            )
        )
        self.start_gpu_plugin()

    @property
    def gpu_plugin(self) -> Component:
        return next(c for c in self.components if c.name == f"fakegpu-{self.name}")

    def start_gpu_plugin(self) -> None:
        """Start the fake GPU device plugin (again): the kubelet registers it from its socket."""
        self.gpu_plugin.start()

    def stop_gpu_plugin(self) -> None:
        """Stop it (SIGTERM: it removes its socket); the kubelet then counts its devices unhealthy, so the
        node's allocatable GPUs drop to 0."""
        self.gpu_plugin.stop()

    def kill_container(self, container_id: str) -> None:
        """SIGKILL a container's process (`containerd://<id>` from a pod's status, or the bare id), as an
        OOM kill or a crash would end it; the kubelet sees it exit 137."""
        self._ctr("tasks", "kill", "--signal=SIGKILL", container_id.removeprefix("containerd://"))

    def teardown(self) -> None:
        """Stop the kubelet, every pod's containers and containerd, and remove everything the node made.
        Safe to call on a node that never started, or on what a killed run left behind."""
        for component in self.components:
            if component.name.startswith(("kubelet-", "dns-", "fakegpu-")):
                component.stop()
        netns: set[str] = set()
        if self.socket.exists() and self._ctr("version", check=False).returncode == 0:
            netns = self._kill_containers()
        containerd = next((c for c in self.components if c.name.startswith("containerd-")), None)
        if containerd is not None:
            containerd.stop()
        self._kill_shims()
        self._unmount_under(self.run_dir, self.dir)
        for path in netns:
            with contextlib.suppress(OSError):
                subprocess.run(["umount", path], capture_output=True)
                os.unlink(path)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._route_to_apiserver(add=False)
        self._remove_cgroups()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- configuration ------------------------------------------------------------------------------------
    def _containerd_config(self) -> Path:
        cri = {
            "sandbox_image": PAUSE_IMAGE,
            "stream_server_address": "127.0.0.1",
            "stream_server_port": "0",
            "enable_selinux": False,
            # The kubelet asks for negative OOM scores (sandboxes -998, Guaranteed pods -997); lowering one
            # needs CAP_SYS_RESOURCE, which a sandboxed root may lack (this VM's does: runc then dies with
            # "can't get final child's PID from pipe: EOF"). Restricted, no score goes below containerd's.
            "restrict_oom_score_adj": True,
            "containerd": {
                "snapshotter": "overlayfs",
                "default_runtime_name": "runc",
                "runtimes": {
                    "runc": {"runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": False}}
                },
            },
            "cni": {"bin_dir": cni_bin_dir(), "conf_dir": str(self.dir / "cni")},
        }
        text = "\n".join(
            [
                "version = 2",
                f'root = "{self.dir / "containerd"}"',
                f'state = "{self.run_dir / "state"}"',
                "[grpc]",
                f'  address = "{self.socket}"',
                "[ttrpc]",
                f'  address = "{self.run_dir / "ttrpc.sock"}"',
                "[metrics]",
                '  address = ""',
                '[plugins."io.containerd.grpc.v1.cri"]',
                *_toml_table(cri, '[plugins."io.containerd.grpc.v1.cri"'),
                '[plugins."io.containerd.internal.v1.opt"]',
                f'  path = "{self.dir / "opt"}"',
            ]
        )
        path = self.dir / "containerd.toml"
        path.write_text(text + "\n")
        return path

    def _kubelet_config(self) -> Path:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # Kubernetes >= 1.35 refuses cgroup v1 unless told; this machine mounts v1 hierarchies with
            # cgroup2 beside them at /sys/fs/cgroup/unified, so v1 is what runc and the kubelet use.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": node_ip(),
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.dir / "pod-logs"),
            "failSwapOn": False,
            "clusterDomain": "cluster.local",
            # The node's own small DNS (colocate_devcluster.dns) on the bridge's gateway: the apiserver's
            # Service name resolves, nothing else (no CoreDNS, no kube-proxy yet).
            "clusterDNS": [str(next(self.subnet.hosts()))],
            "resolvConf": "/etc/resolv.conf",
            "registerNode": True,
            "rotateCertificates": False,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "nodeStatusReportFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
            "volumePluginDir": str(self.dir / "volume-plugins"),
        }
        path = self.dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _kubeconfig(self) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "devcluster",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_cert)},
                }
            ],
            "users": [{"name": self.name, "user": {"token": self.token}}],
            "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": self.name}}],
            "current-context": "devcluster",
        }
        path = self.dir / "kubelet.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def _network(self) -> None:
        """The CNI bridge network (no masquerade: pods reach this machine, nothing beyond it) and a route
        for the pods to the apiserver: the `kubernetes` Service's ClusterIP is DNAT'ed to the apiserver on
        127.0.0.1, as kube-proxy does for localhost NodePorts (route_localnet on the bridge)."""
        gateway = str(next(self.subnet.hosts()))
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], capture_output=True)
        _run("ip", "addr", "replace", f"{gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1")
        self._route_to_apiserver(add=True)
        conflist = {
            "cniVersion": "0.4.0",
            "name": f"colocate-{self.name}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(self.subnet), "gateway": gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.dir / "cni-ipam"),
                    },
                }
            ],
        }
        (self.dir / "cni").mkdir(exist_ok=True)
        (self.dir / "cni" / "10-colocate.conflist").write_text(json.dumps(conflist, indent=1))

    def _route_to_apiserver(self, add: bool) -> None:
        port = self.server.rsplit(":", 1)[1]
        rule = [
            "PREROUTING", "-i", self.bridge, "-d", SERVICE_HOST, "-p", "tcp", "--dport", "443",
            "-j", "DNAT", "--to-destination", f"127.0.0.1:{port}",
            "-m", "comment", "--comment", f"colocate {self.name}",
        ]  # fmt: skip
        present = subprocess.run(["iptables", "-t", "nat", "-C", *rule], capture_output=True).returncode == 0
        if add and not present:
            _run("iptables", "-t", "nat", "-A", *rule)
        if not add:
            # Every rule a run of this node left, whatever the apiserver's port was then.
            listing = subprocess.run(
                ["iptables", "-t", "nat", "-S", "PREROUTING"], capture_output=True, text=True
            )
            for line in listing.stdout.splitlines():
                if f"-i {self.bridge} " in line and line.startswith("-A "):
                    subprocess.run(
                        ["iptables", "-t", "nat", "-D", *shlex.split(line)[1:]], capture_output=True
                    )

    def _cgroups(self) -> None:
        """The kubelet's cgroupRoot must exist in every v1 hierarchy (cpuset's needs its CPUs and memory
        nodes filled in, or no task may join it)."""
        for hierarchy in _v1_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if (hierarchy / "cpuset.cpus").exists():
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (path / f).write_text((hierarchy / f).read_text())

    def _remove_cgroups(self) -> None:
        for hierarchy in [*_v1_hierarchies(), Path("/sys/fs/cgroup/unified")]:
            top = hierarchy / self.cgroup_root.lstrip("/")
            if top.is_dir():
                for directory in sorted(
                    (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
                ):
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                with contextlib.suppress(OSError):
                    top.rmdir()

    # -- containerd ---------------------------------------------------------------------------------------
    def _ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["ctr", f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ComponentError(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def _import_images(self) -> None:
        listing = self.images / "images.txt"
        if not listing.is_file():
            raise ComponentError(f"no images in {self.images}; run `make images` (scripts/build-images.sh)")
        for line in listing.read_text().splitlines():
            ref, archive = line.split()
            self._ctr("images", "import", "--no-unpack=false", str(self.images / archive))
            self.say(f"{self.name}: imported {ref}")

    def _kill_containers(self) -> set[str]:
        """Kill and delete every container; returns the pod sandboxes' network namespaces to remove."""
        netns: set[str] = set()
        ids = self._ctr("containers", "list", "--quiet", check=False).stdout.split()
        for cid in ids:
            info = self._ctr("containers", "info", cid, check=False)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for ns in json.loads(info.stdout)["Spec"]["linux"]["namespaces"]:
                    if ns.get("type") == "network" and ns.get("path", "").startswith("/var/run/netns/"):
                        netns.add(ns["path"])
            self._ctr("tasks", "kill", "--signal=SIGKILL", cid, check=False, timeout=30)
        deadline = time.monotonic() + 10
        for cid in ids:
            while self._ctr("tasks", "delete", cid, check=False, timeout=30).returncode != 0:
                if (
                    "not found" in self._ctr("tasks", "list", check=False).stdout
                    or time.monotonic() > deadline
                ):
                    break
                if cid not in self._ctr("tasks", "list", "--quiet", check=False).stdout.split():
                    break
                time.sleep(0.2)
            self._ctr("containers", "delete", cid, check=False, timeout=30)
        return netns

    def _kill_shims(self) -> None:
        """containerd's shims outlive it; end those of this node's containerd (by their -address)."""
        needle = str(self.socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes()
                if b"containerd-shim" in cmdline and needle in cmdline:
                    os.kill(int(proc.name), signal.SIGKILL)

    @staticmethod
    def _unmount_under(*roots: Path) -> None:
        prefixes = tuple(str(r.resolve()) + "/" for r in roots)
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(prefixes)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)


def _v1_hierarchies() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [p for p in root.iterdir() if p.is_dir() and p.name != "unified" and (p / "tasks").exists()]


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise ComponentError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _toml_table(table: dict, prefix: str) -> list[str]:
    """Just enough TOML for containerd's CRI section: scalars first, then nested tables."""
    lines: list[str] = []
    for key, value in table.items():
        if not isinstance(value, dict):
            lines.append(f"  {key} = {json.dumps(value)}")
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}.{key}"
            lines.append(f"{name}]")
            lines.extend(_toml_table(value, name))
    return lines
