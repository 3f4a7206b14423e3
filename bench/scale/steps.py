"""Step events for the "status writes per step" measurement: a local Redis, and an emitter that makes every
job report one completed weight-update step per second on its step-event stream.

The entries follow runtime/colocated/events.py (schema v1). Only what completes a step for the operator is
written: one trainer `finished` record with `result=ok` per GPU of the job (4 pods x 8 GPUs = 32 per job and
step); the runtime's intermediate phases are left out, so this is the least stream traffic a real job sends.
The records are generated inside Redis by a Lua script, so the emitter itself costs little CPU.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.scale.operators import free_port
from colocate_runtime.colocated.events import STREAM_MAXLEN, stream_key

# KEYS[1]: the job's stream; ARGV: step, ts, pods, GPUs per pod, maxlen.
EMIT_STEP = """
local step, ts = ARGV[1], ARGV[2]
local pods, gpus = tonumber(ARGV[3]), tonumber(ARGV[4])
for r = 0, pods - 1 do
  for g = 0, gpus - 1 do
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[5], '*',
      'v', '1', 'role', 'trainer', 'gen', '0', 'step', step, 'phase', 'finished', 'result', 'ok',
      'seconds', '0.500000', 'phase_seconds', '{}', 'bytes', '1073741824', 'handles', '1',
      'replica', tostring(r), 'rank', tostring(r * gpus + g), 'gpu', 'GPU-bench-' .. r .. '-' .. g,
      'weight_version', step, 'final', 'false', 'error', '', 'ts', ts)
  end
end
return pods * gpus
"""


@dataclass
class LocalRedis:
    workdir: Path
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20) -> LocalRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is needed for the step-event runs (apt-get install redis-server)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / "redis.log").open("ab") as log:
            # The password goes through stdin (a config read from "-"), never on the command line.
            self.process = subprocess.Popen(
                [binary, "-"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            assert self.process.stdin is not None
            config = (
                f'port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave ""\n'
                f"appendonly no\ndir {self.workdir}\n"
            )
            self.process.stdin.write(config.encode())
            self.process.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"redis-server not answering on {self.address} after {timeout:.0f} s")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Emitter:
    """Every `interval` seconds, one step for every job (step 1, 2, ...), until stopped."""

    redis_: LocalRedis
    namespace: str
    jobs: list[str]
    pods: int
    gpus_per_pod: int
    interval: float = 1.0
    steps: int = 0
    late_rounds: int = 0  # rounds that took longer than the interval
    round_seconds: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Emitter:
        self._thread = threading.Thread(target=self._run, name="step-emitter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def emit_round(self, client: redis.Redis) -> float:
        """One step for every job (pipelined); seconds it took."""
        started = time.monotonic()
        script = client.register_script(EMIT_STEP)
        step, now = str(self.steps + 1), f"{time.time():.6f}"
        pipe = client.pipeline(transaction=False)
        for job in self.jobs:
            key = stream_key(self.namespace, job)
            script(keys=[key], args=[step, now, self.pods, self.gpus_per_pod, STREAM_MAXLEN], client=pipe)
        pipe.execute()
        self.steps += 1
        return time.monotonic() - started

    def _run(self) -> None:
        client = self.redis_.client()
        next_round = time.monotonic()
        while not self._stop.is_set():
            took = self.emit_round(client)
            self.round_seconds.append(took)
            next_round += self.interval
            if took > self.interval:
                self.late_rounds += 1
                next_round = time.monotonic()
            self._stop.wait(max(0.0, next_round - time.monotonic()))
