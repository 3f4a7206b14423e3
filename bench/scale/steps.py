"""Step events for the "status writes per step" measurement: an emitter that makes every job report one
completed weight-update step per second on its step-event stream, in the local Redis the testbed starts
(colocate_devcluster.localredis, the launcher tests and the demo share).

The entries follow runtime/contract/events.py (schema v1). Only what completes a step for the operator is
written: one trainer `finished` record with `result=ok` per GPU of the job (4 pods x 8 GPUs = 32 per job and
step); the runtime's intermediate phases are left out, so this is the least stream traffic a real job sends.
The records are generated inside Redis by a Lua script, so the emitter itself costs little CPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import redis

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import STREAM_MAXLEN, stream_key

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
class Emitter:
    """Every `interval` seconds, one step for every job (step 1, 2, ...), until stopped."""

    redis_: RedisServer
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
        client = self.redis_.client(socket_timeout=10)  # a 250-job round is one long pipeline
        next_round = time.monotonic()
        while not self._stop.is_set():
            took = self.emit_round(client)
            self.round_seconds.append(took)
            next_round += self.interval
            if took > self.interval:
                self.late_rounds += 1
                next_round = time.monotonic()
            self._stop.wait(max(0.0, next_round - time.monotonic()))
