"""A real redis-server for runtime tests: free 127.0.0.1 port, a password, no persistence, killed at teardown.

Import the fixtures into a test module (`from tests.runtime.redis_fixture import redis_server  # noqa: F401`).
`RedisServer.restart()` kills and restarts the server on the same port (it comes back empty, like a Redis
pod that was rescheduled). The binary is `$COLOCATE_REDIS_SERVER`, else `redis-server` on PATH.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from colocate_runtime.colocated.config import MetaStoreAddress


def redis_binary() -> str | None:
    return os.environ.get("COLOCATE_REDIS_SERVER") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> MetaStoreAddress:
        return MetaStoreAddress("127.0.0.1", self.port, self.password)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 (owned by the process)
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start on {self.addr}; see {self.workdir}"
                    ) from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def env(self) -> dict[str, str]:
        return {"COLOCATE_METASTORE_ADDR": self.addr, "COLOCATE_METASTORE_PASSWORD": self.password}


@contextlib.contextmanager
def started_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found (install Debian's redis-server or set COLOCATE_REDIS_SERVER)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with started_redis(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for a module's tests (those that share a slow-to-start peer, such as real SGLang)."""
    with started_redis(tmp_path_factory) as server:
        yield server
