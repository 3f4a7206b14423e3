"""Child processes of the local cluster: start, probe readiness, stop, and explain a death."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class ComponentError(RuntimeError):
    """A component could not start, died, or never became ready; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])


def http_ok(url: str, token: str | None = None, ca: Path | None = None, timeout: float = 2.0) -> bool:
    """True when GET url answers 200. Components' own self-signed health ports are probed without
    verification; the apiserver is probed against our CA."""
    if url.startswith("https"):
        context = ssl.create_default_context(cafile=str(ca)) if ca else ssl._create_unverified_context()
    else:
        context = None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int | None = None
    wanted: bool = False  # started and not stopped on purpose: devcluster/supervise.py restarts it

    def start(self) -> None:
        if not os.access(self.argv[0], os.X_OK):
            raise ComponentError(
                f"{self.name}: binary {self.argv[0]} is missing or not executable; run `make setup`"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Own session: the whole process group can be signalled, and `devcluster up` can exit and leave
            # the cluster running.
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.process.pid
        self.wanted = True

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and _pid_alive(self.pid)

    def explain_death(self) -> ComponentError:
        tail = log_tail(self.log_path)
        hint = ""
        if "address already in use" in tail.lower():
            hint = " (a port it needs is taken: stop whatever holds it, or run `devcluster down`)"
        code = self.process.returncode if self.process is not None else "?"
        return ComponentError(
            f"{self.name} exited with code {code}{hint}; last log lines of {self.log_path}:\n{tail}"
        )

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.explain_death()
            if ready():
                return
            time.sleep(0.25)
        raise ComponentError(
            f"{self.name} not {what} after {timeout:.0f} s; last log lines of {self.log_path}:\n"
            + log_tail(self.log_path)
        )

    def stop(self, grace: float = 10.0) -> None:
        self.wanted = False
        if self.pid is None or not self.alive():
            return
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            _signal_group(self.pid, signal.SIGKILL)
            if self.process is not None:
                self.process.wait(timeout=10)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
