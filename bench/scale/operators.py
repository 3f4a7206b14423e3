"""The two operators as subprocesses, each watching only the namespace of its run, with their default
settings, and a sampler of their CPU time and resident memory (psutil, the whole process tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from colocate_devcluster.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass
class OperatorProcess:
    name: str  # "colocate" | "kuberay"
    argv: list[str]
    ready_url: str
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120) -> OperatorProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} operator exited with {self.process.returncode}: {self.tail()}"
                )
            if _http_ok(self.ready_url):
                return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} operator not ready after {timeout:.0f} s: {self.tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 15) -> None:
        if not self.alive():
            return
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def colocate_operator(
    namespace: str, kubeconfig: Path, log_path: Path, *, with_steps: bool = False, pythonpath: str = ""
) -> OperatorProcess:
    """`python -m colocate_operator`; with_steps: through the launcher that makes sure the step-event
    handlers are registered; pythonpath: where its packages come from (see source.py)."""
    port = free_port()
    return OperatorProcess(
        "colocate" if with_steps else "colocate-managed",
        [
            sys.executable,
            "-m",
            "bench.scale.colocate_with_steps" if with_steps else "colocate_operator",
            "--namespace",
            namespace,
            "--liveness",
            f"http://127.0.0.1:{port}/healthz",
        ],
        f"http://127.0.0.1:{port}/healthz",
        log_path,
        {
            "KUBECONFIG": str(kubeconfig),
            # The jobs' External meta-store is the testbed's redis-server on this machine.
            "COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1",
            **({"PYTHONPATH": pythonpath} if pythonpath else {}),
        },
    )


def kuberay_operator(binary: Path, namespace: str, kubeconfig: Path, log_path: Path) -> OperatorProcess:
    metrics, probe = free_port(), free_port()
    return OperatorProcess(
        "kuberay",
        [
            str(binary),
            f"-kubeconfig={kubeconfig}",
            "-enable-leader-election=false",
            f"-watch-namespace={namespace}",
            f"-metrics-addr=127.0.0.1:{metrics}",
            f"-health-probe-bind-address=127.0.0.1:{probe}",
        ],
        f"http://127.0.0.1:{probe}/readyz",
        log_path,
        {"KUBECONFIG": str(kubeconfig)},
    )


@dataclass
class Usage:
    cpu_seconds: float  # user + system of the tree, since the process started
    rss_bytes: int  # of the tree, now


def usage(pid: int) -> Usage:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return Usage(0.0, 0)
    cpu, rss = 0.0, 0
    for proc in procs:
        try:
            times = proc.cpu_times()
            cpu += times.user + times.system
            rss += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return Usage(cpu, rss)


def peak_rss(pid: int) -> int:
    """The kernel's high-water mark of the process's resident set (VmHWM), 0 if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Sampler:
    """Samples the process tree every `interval` seconds in a thread; keeps the peak tree RSS."""

    pid: int
    interval: float = 0.5
    peak_rss_bytes: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (time, cpu s, rss)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> Usage:
        now = usage(self.pid)
        self.peak_rss_bytes = max(self.peak_rss_bytes, now.rss_bytes)
        self.samples.append((time.time(), now.cpu_seconds, now.rss_bytes))
        return now

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
