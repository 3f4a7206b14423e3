"""Summary mode of the step-event stream (contract/events.py, "Summary mode"): one `completed` record a step
for the whole job instead of one `finished` record a GPU.

Why: the operator reads every job's stream on one core. At 1000 jobs of 32 GPUs stepping once a second the
per-GPU records are 32,000 entries a second, more than its reader decodes (docs/benchmarks.md); folding them
in the job's store first leaves it one entry a job and step.

Each GPU's successful finish goes into the step's hash `{p}:finished:s{step}` (GPU UUID -> its gen and
figures, with the key TTL), in one script that also checks whether the set is complete: when as many GPUs as
`COLOCATE_STEP_SUMMARY_GPUS` have finished, the script adds the `completed` record to the stream and deletes
the hash, so exactly one GPU's call writes it. A finish of an older incarnation of a GPU's trainer (its gen
below the GPU's counter `{p}:gen:{uuid}`) is dropped there: after a gang restart the new incarnation's steps
are complete only when its own GPUs finish them, as the operator's per-GPU fold decides it. A step some GPU
never finishes (it failed: its `failed` record goes to the stream as always) leaves its hash to the TTL.
"""

from __future__ import annotations

from dataclasses import replace

from colocate_runtime.contract.events import StepEvent, encode

# KEYS[1]: the step's hash; KEYS[2]: the stream.
# ARGV[1]: GPU; ARGV[2]: "gen seconds bytes handles ts" of its finish; ARGV[3]: the job's GPUs; ARGV[4]: TTL
# (ms); ARGV[5]: the stream's MAXLEN; ARGV[6]: the GPU counters' prefix `{p}:gen:`; ARGV[7..]: the
# `completed` record's fields as `encode` writes them (key, value, ...), whose seconds, bytes, handles and ts
# the script sets. The counters' keys are built here from ARGV[6]: which GPUs finished is known only inside
# (a single Redis, as the rest of the protocol assumes; the ACL allows the job's prefix).
FINISH_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local have, need = redis.call('HLEN', KEYS[1]), tonumber(ARGV[3])
if have == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end  -- from the step's first finish
if have < need then return 0 end
local all = redis.call('HGETALL', KEYS[1])
local count, secs, nbytes, handles, ts = 0, 0, 0, 0, 0
for i = 1, #all, 2 do
  local gen, s, b, h, t = string.match(all[i + 1], '^(%d+) (%S+) (%d+) (%d+) (%S+)$')
  local current = redis.call('GET', ARGV[6] .. all[i])
  if gen and (not current or tonumber(gen) >= tonumber(current)) then
    count = count + 1
    secs = math.max(secs, tonumber(s))
    nbytes = nbytes + tonumber(b)
    handles = handles + tonumber(h)
    ts = math.max(ts, tonumber(t))
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
if count < need then return 0 end
redis.call('DEL', KEYS[1])
local set = {seconds = string.format('%.6f', secs), bytes = string.format('%.0f', nbytes),
             handles = string.format('%.0f', handles), ts = string.format('%.6f', ts)}
local fields = {}
for i = 7, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = set[ARGV[i]] or ARGV[i + 1]
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(fields))
return 1
"""


def finish_args(event: StepEvent, gpus: int, ttl_ms: int, maxlen: int, gen_prefix: str) -> list[str]:
    """The script's ARGV for one GPU's successful `finished` record (`is_summarized`)."""
    figures = encode(event)  # fills ts from the clock when the event has none
    own = f"{event.gen} {figures['seconds']} {event.bytes} {event.handles} {figures['ts']}"
    completed = completed_fields(event, float(figures["ts"]))
    return [
        event.gpu or f"rank-{event.rank}",
        own,
        str(gpus),
        str(ttl_ms),
        str(maxlen),
        gen_prefix,
        *completed,
    ]


def completed_fields(event: StepEvent, ts: float) -> list[str]:
    """The `completed` record, flat (key, value, ...), that `event`'s finish writes if it is the last; the
    script sets its seconds, bytes, handles and ts from the whole set."""
    fields = encode(replace(event, phase="completed", gpu="", phase_seconds={}), now=ts)
    return [part for item in fields.items() for part in item]
