"""Step events for the "status writes per step" measurement: an emitter that makes every job report one
completed weight-update step per second on its step-event stream, in the local Redis the testbed starts
(colocate_devcluster.localredis, the launcher tests and the demo share).

The entries follow runtime/contract/events.py (schema v1). Only what completes a step for the operator is
written, in one of three ways (`records`):
- "job" (the scale bench's default): the step's one `completed` record per job, as the runtime's script
  leaves it, XADDed directly. In summary mode (the operator sets COLOCATE_STEP_SUMMARY_GPUS) that record is
  all the operator reads. The 32 script calls that make it run, on a cluster, in each job's own Redis, not
  on the control plane's machine; here, 32,000 a second for 1000 jobs held about a core of the 2 the
  control plane and the operator share (docs/benchmarks.md), so they are left out of the window that times
  the operator. stream_bench measures the script's cost itself.
- "gpu": each of the job's 32 GPUs (4 pods x 8) hands its `finished` record to the runtime's own script
  (runtime/colocated/step_summary.py), and the last one adds the step's `completed` record: the pods' path.
- "detailed": what a runtime in detailed mode writes: the 32 `finished` records.
The runtime's intermediate phases are left out. The records are generated inside Redis by a Lua script, so
the emitter itself costs little CPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import redis

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import default_key_ttl
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.contract.env import STEP_TIMEOUT_SECONDS
from colocate_runtime.contract.events import STREAM_MAXLEN, StepEvent

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

# KEYS: the step's set and the stream; ARGV: step, ts, pods, GPUs per pod, maxlen, TTL (ms), the GPU
# counters' prefix, then the `completed` record's fields. Each GPU's finish runs the runtime's script itself.
_EMIT_STEP_SUMMARY = """
end
local ts, pods, gpus = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local written = 0
for r = 0, pods - 1 do
  for g = 0, gpus - 1 do
    local args = {'GPU-bench-' .. r .. '-' .. g, '0 0.500000 1073741824 1 ' .. ts, tostring(pods * gpus),
                  ARGV[6], ARGV[5], ARGV[7]}
    for i = 8, #ARGV do args[#args + 1] = ARGV[i] end
    written = written + finish(KEYS, args)
  end
end
return written
"""


# KEYS[1]: the job's stream; ARGV: maxlen, then the `completed` record's fields.
EMIT_COMPLETED = """
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 2))
"""
RECORDS = ("job", "gpu", "detailed")


def emit_step_summary() -> str:
    """The summary emitter's script: the runtime's own as a function (imported here, not at the top, so
    that stream_bench --source can measure a checkout from before summary mode with the detailed one)."""
    from colocate_runtime.colocated.step_summary import FINISH_SCRIPT

    return "local function finish(KEYS, ARGV)\n" + FINISH_SCRIPT + _EMIT_STEP_SUMMARY


KEY_TTL_MS = 1000 * default_key_ttl(float(STEP_TIMEOUT_SECONDS.default))  # the runtime's default


def completed_fields(step: int, ts: float, pods: int, gpus_per_pod: int, whole: bool = False) -> list[str]:
    """The `completed` record the summary script fills in, as the job's last GPU makes it; `whole`: with
    the figures the script sets filled in (every GPU's 1 GiB and handle summed), as it lands in the stream."""
    from colocate_runtime.colocated import step_summary  # lazily: see emit_step_summary

    gpus = pods * gpus_per_pod
    last = StepEvent("trainer", 0, step, "finished", "ok", 0.5, {}, 1 << 30, 1, pods - 1, gpus - 1)
    if whole:
        last = replace(last, bytes=gpus << 30, handles=gpus)
    return step_summary.completed_fields(replace(last, weight_version=str(step)), ts)


@dataclass
class Emitter:
    """Every `interval` seconds, one step for every job (step 1, 2, ...), until stopped."""

    redis_: RedisServer
    namespace: str
    jobs: list[str]
    pods: int
    gpus_per_pod: int
    interval: float = 1.0
    records: str = "job"  # one of RECORDS (module docstring)
    steps: int = 0
    late_rounds: int = 0  # rounds that took longer than the interval
    last_round_at: float | None = None  # wall time the last round began writing (its step's earliest record)
    round_seconds: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.records not in RECORDS:
            raise ValueError(f"records must be one of {', '.join(RECORDS)}, not {self.records!r}")

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
        started, self.last_round_at = time.monotonic(), time.time()
        script = client.register_script(self._script())
        now = time.time()
        step, ts = self.steps + 1, f"{now:.6f}"
        args: list[object] = [str(step), ts, self.pods, self.gpus_per_pod, STREAM_MAXLEN]
        record: list[str] = []
        if self.records != "detailed":  # "job": the figures summed, as the last GPU's script call sets them
            record = completed_fields(step, now, self.pods, self.gpus_per_pod, whole=self.records == "job")
        pipe = client.pipeline(transaction=False)
        for job in self.jobs:
            keys = KeySchema(self.namespace, job)
            if self.records == "job":
                script(keys=[keys.events()], args=[STREAM_MAXLEN, *record], client=pipe)
            elif self.records == "gpu":
                job_args = [*args, KEY_TTL_MS, keys.gen_prefix(), *record]
                script(keys=[keys.finished(step), keys.events()], args=job_args, client=pipe)
            else:
                script(keys=[keys.events()], args=args, client=pipe)
        pipe.execute()
        self.steps += 1
        return time.monotonic() - started

    def _script(self) -> str:
        if self.records == "job":
            return EMIT_COMPLETED
        return emit_step_summary() if self.records == "gpu" else EMIT_STEP

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
