"""The meta-store's key schema (pure: strings only).

Every key of one job starts with `colocate:{namespace}:{job}` (`{p}` below). Keys of one trainer incarnation
carry its generation `g{gen}`, so a restarted trainer never reads its predecessor's keys. Generations count
per GPU (every trainer process of a job starts its own, and a job-wide counter would let one GPU's trainer
hide another's keys from its reader); per-step keys carry
`s{step}`, per-GPU keys the GPU's UUID (never a device index: the two containers may enumerate GPUs
differently).

| key | type | written by | content |
|---|---|---|---|
| `{p}:gen:{uuid}` | counter | trainer (`INCR` at start) | current incarnation on that GPU |
| `{p}:engine:{uuid}` | counter | SGLang side (`INCR` at start) | engine instance on that GPU (repush.py) |
| `{p}:trainer:{uuid}` | JSON | trainer (`colocate_runtime.megatron`, at start) | convert/published.py |
| `{p}:events` | stream | both sides | step events for the operator (contract/events.py) |
| `{p}:finished:s{step}` | hash, TTL | trainer (summary mode) | UUID -> its finish (step_summary.py) |
| `{p}:hb:{role}:{uuid}` | string, TTL | each process (`trainer`, `reader`) | JSON: pid, host, state |
| `{p}:g{gen}:abort` | string, TTL | anyone | reason; aborts every step of the incarnation |
| `{p}:g{gen}:ready:{uuid}` | list, TTL | trainer | step numbers whose manifest is published |
| `{p}:g{gen}:s{step}:manifest:{uuid}` | bytes (msgpack), TTL, NX | trainer | manifest.py |
| `{p}:g{gen}:s{step}:claim:{uuid}` | string, TTL, NX | reader before opening / trainer | see below |
| `{p}:g{gen}:s{step}:ack:{uuid}` | JSON, TTL, NX | the claimant | manifest.Ack (`ipc_closed`, opened) |
| `{p}:g{gen}:s{step}:ackq:{uuid}` | list, TTL | reader | a token pushed with the ACK (trainer blocks on it) |
| `{p}:g{gen}:s{step}:abort` | string, TTL | anyone | reason; aborts this step |
| `{p}:preflight:r{replica}` | hash, TTL | trainer | UUID -> JSON `{gen, attempt}`: the pod's newest offers |
| `{p}:preflight:q:{uuid}` | list, TTL | trainer | `gen:attempt` per offer (the reader side blocks on it) |
| `{p}:g{gen}:pf{n}:offer:{uuid}` | bytes (msgpack), TTL, NX | trainer | preflight attempt `n`: preflight.py |
| `{p}:g{gen}:pf{n}:claim:{uuid}` | string, TTL, NX | reader before opening / trainer | reader / `revoked` |
| `{p}:g{gen}:pf{n}:result:{uuid}` | JSON, TTL, NX | reader | the verdict, written after the verified close |
| `{p}:g{gen}:pf{n}:resultq:{uuid}` | list, TTL | reader | a token pushed with the verdict (trainer waits) |

A suspend's checkpoint request, ACKs and resume step are under `{p}:checkpoint:` (contract/checkpoint.py).

A step's claim is `revoked` (the trainer gave up first) or `reader:{host}:{pid}:{instance}:{sha1(proof)}`:
the reader instance that claimed it and the digest of a per-step proof; only an ACK carrying that proof is
written (metastore.write_ack) and counted by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.contract.events import stream_key
from colocate_runtime.contract.jobkeys import job_prefix

ROLES = ("trainer", "reader")


@dataclass(frozen=True, slots=True)
class KeySchema:
    namespace: str
    job: str

    @property
    def prefix(self) -> str:
        return job_prefix(self.namespace, self.job)

    def gen(self, uuid: str) -> str:
        return f"{self.gen_prefix()}{uuid}"

    def engine(self, uuid: str) -> str:
        return f"{self.prefix}:engine:{uuid}"

    def trainer_record(self, uuid: str) -> str:
        """What the trainer rank on GPU `uuid` publishes (convert/published.py), for the SGLang loader."""
        return f"{self.prefix}:trainer:{uuid}"

    def events(self) -> str:
        return stream_key(self.namespace, self.job)

    def gen_prefix(self) -> str:
        """What `gen(uuid)` puts before the UUID (the summary script builds the counters' keys from it)."""
        return f"{self.prefix}:gen:"

    def finished(self, step: int) -> str:
        """Summary mode: the GPUs that finished `step` (step_summary.py)."""
        return f"{self.prefix}:finished:s{step}"

    def heartbeat(self, role: str, uuid: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {ROLES}")
        return f"{self.prefix}:hb:{role}:{uuid}"

    def gen_abort(self, gen: int) -> str:
        return f"{self.prefix}:g{gen}:abort"

    def ready(self, gen: int, uuid: str) -> str:
        return f"{self.prefix}:g{gen}:ready:{uuid}"

    def step_prefix(self, gen: int, step: int) -> str:
        return f"{self.prefix}:g{gen}:s{step}"

    def manifest(self, gen: int, step: int, uuid: str) -> str:
        return f"{self.step_prefix(gen, step)}:manifest:{uuid}"

    def claim(self, gen: int, step: int, uuid: str) -> str:
        return f"{self.step_prefix(gen, step)}:claim:{uuid}"

    def layout(self, gen: int, uuid: str, ref: str) -> str:
        """A large layout's packed entries, written once and named by manifests (manifest.py)."""
        return f"{self.prefix}:g{gen}:layout:{uuid}:{ref}"

    def ack(self, gen: int, step: int, uuid: str) -> str:
        return f"{self.step_prefix(gen, step)}:ack:{uuid}"

    def ack_queue(self, gen: int, step: int, uuid: str) -> str:
        return f"{self.step_prefix(gen, step)}:ackq:{uuid}"

    def step_abort(self, gen: int, step: int) -> str:
        return f"{self.step_prefix(gen, step)}:abort"

    def preflight_index(self, replica: int) -> str:
        return f"{self.prefix}:preflight:r{replica}"

    def preflight_queue(self, uuid: str) -> str:
        return f"{self.prefix}:preflight:q:{uuid}"

    def preflight_prefix(self, gen: int, attempt: int) -> str:
        return f"{self.prefix}:g{gen}:pf{attempt}"

    def preflight_offer(self, gen: int, attempt: int, uuid: str) -> str:
        return f"{self.preflight_prefix(gen, attempt)}:offer:{uuid}"

    def preflight_claim(self, gen: int, attempt: int, uuid: str) -> str:
        return f"{self.preflight_prefix(gen, attempt)}:claim:{uuid}"

    def preflight_result(self, gen: int, attempt: int, uuid: str) -> str:
        return f"{self.preflight_prefix(gen, attempt)}:result:{uuid}"

    def preflight_result_queue(self, gen: int, attempt: int, uuid: str) -> str:
        return f"{self.preflight_prefix(gen, attempt)}:resultq:{uuid}"

    def step_keys(self, gen: int, step: int, uuid: str) -> tuple[str, ...]:
        """Every per-GPU key of one step (for deletion of old steps); the step's abort key is shared."""
        return (
            self.manifest(gen, step, uuid),
            self.claim(gen, step, uuid),
            self.ack(gen, step, uuid),
            self.ack_queue(gen, step, uuid),
        )
