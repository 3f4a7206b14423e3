"""A real redis-server on 127.0.0.1 for tests, benchmarks and the demo: a free port, a password, no
persistence. The one launcher they share (free ports come from processes.free_port).

The password reaches the server through its configuration on stdin, never its command line (which `ps` shows
to every user). `restart()` kills and starts it again on the same port: it comes back empty, as a Redis pod
that was rescheduled. The binary is `$COLOCATE_REDIS_SERVER`, else `redis-server` on PATH.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from colocate_devcluster.processes import free_port

HOST = "127.0.0.1"


def redis_binary() -> str | None:
    return os.environ.get("COLOCATE_REDIS_SERVER") or shutil.which("redis-server")


def acl_lines(redis_conf: str) -> str:
    """The `user` lines of a redis.conf (the operator's managed meta-store Secret holds one)."""
    return "".join(line + "\n" for line in redis_conf.splitlines() if line.startswith("user "))


@dataclass
class RedisServer:
    workdir: Path  # holds its log (and nothing else: no persistence)
    binary: str = field(default_factory=lambda: redis_binary() or "redis-server")
    host: str = HOST  # another loopback address stands in for a Service IP
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    # Extra config lines: the `user` (ACL) lines of a managed meta-store's redis.conf (`acl_lines`), so that a
    # stand-in for the job's Redis pod admits its worker user as that pod does.
    acl: str = field(default="", repr=False)
    process: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        """host:port, as COLOCATE_METASTORE_ADDR and a ColocateJob's external meta-store spell it."""
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start it and wait (bounded) until it answers an authenticated PING."""
        if shutil.which(self.binary) is None:
            raise RuntimeError(
                f"{self.binary} not found: install Debian's redis-server or set COLOCATE_REDIS_SERVER"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = (
            f'port {self.port}\nbind {self.host}\nrequirepass {self.password}\nsave ""\nappendonly no\n'
            f"dir {self.workdir}\nprotected-mode yes\n{self.acl}"
        )
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "-"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
            )
        assert self.process.stdin is not None
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server did not start on {self.addr} within {timeout_s:.0f} s; "
                            f"see {self.log_path}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill it (nothing to flush: no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, socket_timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=socket_timeout
        )

    def env(self) -> dict[str, str]:
        """The variables a runtime process reads to reach it."""
        return {"COLOCATE_METASTORE_ADDR": self.addr, "COLOCATE_METASTORE_PASSWORD": self.password}
