"""Meta-store client: the colocated protocol's operations on the job's Redis (redis-py, authenticated).

Each method is one protocol operation on the key schema of keys.py. Writes that must not happen twice are
`NX`; a value and its notification are written by one Lua script, so a notification never arrives without its
data; every key carries a TTL. Redis failures surface as `MetaStoreUnavailable` (the callers' wait loops retry
until their deadline), a refused password as `MetaStoreAuthError`. The password never appears in messages.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.manifest import Ack, ManifestError
from colocate_runtime.colocated.step_summary import FINISH_SCRIPT, finish_args
from colocate_runtime.contract import events as ev

P = ParamSpec("P")
R = TypeVar("R")

# SET value NX and, only if it was set, push a notification; 1 = written, 2 = the same value was already
# there (an idempotent retry), 0 = a different value is there.
_SET_NX_NOTIFY = """
if #KEYS == 3 and redis.call('PEXPIRE', KEYS[3], ARGV[2]) == 0 then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then return 2 end
return 0
"""

# The first claimant of a step wins; returns the winner.
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return ARGV[1] end
return redis.call('GET', KEYS[1])
"""

# The reader's whole fetch of a step in one round trip: the manifest; if there is one, the claim (first
# claimant wins, as _CLAIM) and the abort reasons of the incarnation and of the step. No manifest: no claim.
_FETCH_STEP = """
local manifest = redis.call('GET', KEYS[1])
if not manifest then return {false, false, false, false} end
local winner = ARGV[1]
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then winner = redis.call('GET', KEYS[2]) end
return {manifest, winner, redis.call('GET', KEYS[3]), redis.call('GET', KEYS[4])}
"""

# A spinning reader's poll of its ready list (LPOP) that, when the step it takes is the one it expected
# (ARGV[1]: the step after the last it applied), also fetches that step as _FETCH_STEP does (claim ARGV[2],
# TTL ARGV[3]): the step costs one round trip less. {} = nothing ready; {step} = another step (not fetched).
_POLL_STEP = """
local step = redis.call('LPOP', KEYS[1])
if not step then return {} end
if step ~= ARGV[1] then return {step} end
local manifest = redis.call('GET', KEYS[2])
if not manifest then return {step} end
local winner = ARGV[2]
if not redis.call('SET', KEYS[3], ARGV[2], 'NX', 'PX', ARGV[3]) then winner = redis.call('GET', KEYS[3]) end
return {step, manifest, winner, redis.call('GET', KEYS[4]), redis.call('GET', KEYS[5])}
"""

# The reader's ACK (NX), written only by the holder of the step's claim: the claim (KEYS[3]) is the ACK's
# reader (ARGV[4]) and ends with the SHA-1 of the ACK's proof (ARGV[5]). Its token is pushed. A value already
# there that the claimant did not write (forged, not JSON, or without the proof) is replaced, so a stray
# writer cannot lock the claimant out. -1 = not the claimant, 1 = written, 2 = the same ACK was there (a
# retry), 3 = replaced a stray value, 0 = the claimant already wrote a different ACK.
_WRITE_ACK = """
local claim = redis.call('GET', KEYS[3])
if not claim or claim ~= ARGV[4] or string.sub(claim, -40) ~= redis.sha1hex(ARGV[5]) then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then return 2 end
local ok, old = pcall(cjson.decode, current)
if ok and type(old) == 'table' and old['reader'] == claim and type(old['proof']) == 'string'
    and redis.sha1hex(old['proof']) == string.sub(claim, -40) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 3
"""

# A preflight offer (NX) announced in one step: its pod's index names it, and the reader side's queue wakes.
_OFFER_PREFLIGHT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('RPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], -16, -1)
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then return 2 end
return 0
"""

CLAIM_READER = "reader"  # a reader's claim of a step: `reader:{host}:{pid}:{instance}:{sha1(proof)}`
CLAIM_REVOKED = "revoked"


@dataclass(frozen=True, slots=True)
class Claimant:
    """The reader named by a step's claim: its process (for liveness), its instance, and the SHA-1 of the
    step's proof (the claim is public; the proof appears first in the claimant's own ACK)."""

    host: str
    pid: int
    instance: str
    digest: str

    @property
    def identity(self) -> str:
        return reader_identity(self.host, self.pid, self.instance)


def reader_identity(host: str, pid: int, instance: str) -> str:
    """Who a reader is: its process and a fresh token per reader instance (its incarnation)."""
    if ":" in host or ":" in instance or not instance:
        raise ValueError(
            f"reader identity needs a host and an instance without ':', got {host!r}, {instance!r}"
        )
    return f"{CLAIM_READER}:{host}:{pid}:{instance}"


def step_claim(identity: str, proof: str) -> str:
    """The claim value of one step: the reader's identity and the digest of a proof only it knows until its
    ACK shows it, so an ACK is bound to the claim (the writer checks both; see `proves`)."""
    return f"{identity}:{hashlib.sha1(proof.encode()).hexdigest()}"


def is_reader_claim(value: str | None) -> bool:
    return value is not None and (value == CLAIM_READER or value.startswith(CLAIM_READER + ":"))


def parse_claim(value: str | None) -> Claimant | None:
    """The reader named by a claim value; None for `revoked`, a bare legacy `reader`, or garbage."""
    parts = (value or "").split(":")
    if len(parts) != 5 or parts[0] != CLAIM_READER or not parts[2].isdigit() or len(parts[4]) != 40:
        return None
    return Claimant(parts[1], int(parts[2]), parts[3], parts[4])


def proves(claim: str | None, proof: str) -> bool:
    """The proof belongs to the claim: only the claimant could have written an ACK carrying it."""
    who = parse_claim(claim)
    return (
        who is not None
        and bool(proof)
        and hmac.compare_digest(who.digest, hashlib.sha1(proof.encode()).hexdigest())
    )


@dataclass(frozen=True, slots=True)
class StepFetch:
    manifest: bytes
    winner: str  # who holds the step's claim: the fetch's `who` if it won it (or already held it)
    abort_reason: str | None


def _ack(raw: bytes, step: int) -> Ack:
    try:
        return Ack.from_json(raw)
    except ManifestError as err:
        raise MalformedAck(f"step {step}: {err}") from None


def _abort_text(raws: Iterable[bytes | None]) -> str | None:
    for raw in raws:
        if raw is not None:
            d = json.loads(raw)
            return f"{d.get('reason', '')} (by {d.get('who', '?')})"
    return None


class MetaStoreError(RuntimeError):
    pass


class MetaStoreUnavailable(MetaStoreError):
    """Redis cannot be reached (or restarted and lost state); callers retry within their deadline."""


class MetaStoreAuthError(MetaStoreError):
    """Redis refused the password."""


class MetaStoreConflict(MetaStoreError):
    """An NX write found a different value: two writers for one step, or a stale incarnation."""


class NotClaimant(MetaStoreConflict):
    """An ACK from a process that does not hold the step's claim: refused, nothing written."""


class MalformedAck(MetaStoreError):
    """What sits under a step's ACK key (or its queue) does not decode as an ACK: no licence to free."""


def _step_fetch(manifest: bytes, winner: bytes | str, aborts: Iterable[bytes | None]) -> StepFetch:
    return StepFetch(
        manifest=manifest,
        winner=winner.decode() if isinstance(winner, bytes) else str(winner),
        abort_reason=_abort_text(aborts),
    )


def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store = args[0]
        try:
            return fn(*args, **kwargs)
        except redis.AuthenticationError as err:
            raise MetaStoreAuthError(
                f"meta-store {store.address} refused the password (check the Secret the operator mounts as "
                f"COLOCATE_METASTORE_PASSWORD): {type(err).__name__}"
            ) from None
        except redis.ResponseError as err:
            text = str(err)
            if text.startswith(("WRONGPASS", "NOAUTH", "invalid password")):
                raise MetaStoreAuthError(
                    f"meta-store {store.address} refused authentication ({text.split(' ', 1)[0]})"
                ) from None
            raise MetaStoreError(f"meta-store {store.address}: {text}") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
            raise MetaStoreUnavailable(
                f"meta-store {store.address} unreachable: {type(err).__name__}: {err}"
            ) from None

    return wrapper


class MetaStore:
    def __init__(
        self,
        client: redis.Redis,
        keys: KeySchema,
        *,
        key_ttl_s: float,
        address: str = "redis",
        summary_gpus: int = 0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.key_ttl_ms = int(key_ttl_s * 1000)
        self.address = address
        self.summary_gpus = summary_gpus  # 0: detailed step events; else the job's GPUs (step_summary.py)
        self._finish_step = client.register_script(FINISH_SCRIPT)
        self._set_nx_notify = client.register_script(_SET_NX_NOTIFY)
        self._claim = client.register_script(_CLAIM)
        self._fetch_step = client.register_script(_FETCH_STEP)
        self._poll_step = client.register_script(_POLL_STEP)
        self._write_ack = client.register_script(_WRITE_ACK)
        self._offer_preflight = client.register_script(_OFFER_PREFLIGHT)

    @staticmethod
    def connect(
        address: MetaStoreAddress,
        keys: KeySchema,
        *,
        key_ttl_s: float = 600.0,
        socket_timeout_s: float = 5.0,
        summary_gpus: int = 0,
    ) -> MetaStore:
        """A client for the job's Redis; checks the password at once (a wrong one fails here, clearly)."""
        client = redis.Redis(
            host=address.host,
            port=address.port,
            username=address.username,
            password=address.password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(2.0, socket_timeout_s),
            retry=Retry(NoBackoff(), 0),  # the protocol's wait loops retry, within their deadlines
            health_check_interval=0,
        )
        store = MetaStore(client, keys, key_ttl_s=key_ttl_s, address=str(address), summary_gpus=summary_gpus)
        store.ping()
        return store

    def close(self) -> None:
        self.client.close()

    # --- server -------------------------------------------------------------------------------------------

    @_translated
    def ping(self) -> None:
        self.client.ping()

    @_translated
    def server_run_id(self) -> str:
        """Changes when Redis restarts: a restart mid-step lost that step's keys."""
        return str(self.client.info("server")["run_id"])

    # --- incarnation --------------------------------------------------------------------------------------

    @_translated
    def start_incarnation(self, uuid: str) -> int:
        """A new trainer generation on GPU `uuid`; keys of its older generations are ignored from now on."""
        return int(self.client.incr(self.keys.gen(uuid)))

    @_translated
    def current_gen(self, uuid: str) -> int | None:
        raw = self.client.get(self.keys.gen(uuid))
        return None if raw is None else int(raw)

    @_translated
    def restore_gen(self, uuid: str, gen: int) -> None:
        """After a Redis restart the counter is gone; put ours back unless a newer trainer set one."""
        self.client.set(self.keys.gen(uuid), gen, nx=True)

    # --- engine instances (repush.py) ---------------------------------------------------------------------

    @_translated
    def register_engine(self, uuid: str) -> int:
        """A new SGLang-side process serves GPU `uuid`: its engine instance number (the trainer re-pushes its
        current weights to an instance it has not served)."""
        return int(self.client.incr(self.keys.engine(uuid)))

    @_translated
    def engine_instance(self, uuid: str) -> int | None:
        raw = self.client.get(self.keys.engine(uuid))
        return None if raw is None else int(raw)

    # --- the trainer rank's record (convert/published.py) --------------------------------------------------

    @_translated
    def write_trainer_record(self, uuid: str, text: str) -> None:
        """No TTL, like the generation counter: an engine restarted hours later still finds it."""
        self.client.set(self.keys.trainer_record(uuid), text)

    @_translated
    def read_trainer_record(self, uuid: str) -> bytes | None:
        raw = self.client.get(self.keys.trainer_record(uuid))
        return None if raw is None else bytes(raw)

    @_translated
    def clear_step(self, gen: int, step: int, uuid: str) -> None:
        """Forget a step on GPU `uuid` so it can be published again (repush.py): its per-GPU keys and the
        step's abort key (an engine that died mid-step left the step aborted)."""
        self.client.delete(*self.keys.step_keys(gen, step, uuid), self.keys.step_abort(gen, step))

    # --- heartbeats ---------------------------------------------------------------------------------------

    @_translated
    def heartbeat(self, role: str, uuid: str, info: dict[str, Any], ttl_s: float) -> None:
        self.client.set(self.keys.heartbeat(role, uuid), json.dumps(info), px=max(1, int(ttl_s * 1000)))

    @_translated
    def read_heartbeat(self, role: str, uuid: str) -> dict[str, Any] | None:
        raw = self.client.get(self.keys.heartbeat(role, uuid))
        return None if raw is None else json.loads(raw)

    @_translated
    def drop_heartbeat(self, role: str, uuid: str) -> None:
        self.client.delete(self.keys.heartbeat(role, uuid))

    # --- abort --------------------------------------------------------------------------------------------

    @_translated
    def abort(self, gen: int, step: int | None, reason: str, who: str) -> None:
        """Cancel one step (or, with step None, every step of the incarnation). The first reason stays."""
        key = self.keys.gen_abort(gen) if step is None else self.keys.step_abort(gen, step)
        self.client.set(key, json.dumps({"who": who, "reason": reason[:500]}), nx=True, px=self.key_ttl_ms)

    @_translated
    def abort_reason(self, gen: int, step: int | None) -> str | None:
        keys = [self.keys.gen_abort(gen)] + ([] if step is None else [self.keys.step_abort(gen, step)])
        return _abort_text(self.client.mget(keys))

    # --- one step -----------------------------------------------------------------------------------------

    @_translated
    def publish_manifest(
        self, gen: int, step: int, uuid: str, blob: bytes, *, layout: tuple[str, bytes] | None = None
    ) -> bool:
        """Write the manifest (NX) and push the step onto the GPU's ready list. False: an identical retry.
        `layout` (reference, packed entries): the layout the manifest names, kept alive in the same round
        trip; written first when the store does not hold it (a new layout, or expired)."""
        keys = [self.keys.manifest(gen, step, uuid), self.keys.ready(gen, uuid)]
        if layout is not None:
            keys.append(self.keys.layout(gen, uuid, layout[0]))
        args = [blob, self.key_ttl_ms, str(step)]
        result = self._set_nx_notify(keys=keys, args=args)
        if int(result) == -1 and layout is not None:
            self.client.set(keys[2], layout[1], px=self.key_ttl_ms)
            result = self._set_nx_notify(keys=keys, args=args)
        if int(result) == 0:
            raise MetaStoreConflict(
                f"step {step} of generation {gen} on {uuid} already has a different manifest"
            )
        return int(result) == 1

    @_translated
    def pop_ready(self, gen: int, uuid: str, timeout_s: float) -> int | None:
        """Block at most `timeout_s` for the next published step on this GPU."""
        got = self.client.blpop([self.keys.ready(gen, uuid)], timeout=max(timeout_s, 0.01))
        return None if got is None else int(got[1])

    @_translated
    def poll_ready(self, gen: int, uuid: str) -> int | None:
        """`pop_ready` without blocking: one LPOP, for a reader that spins before it blocks."""
        got = self.client.lpop(self.keys.ready(gen, uuid))
        return None if got is None else int(got)

    @_translated
    def poll_step(self, gen: int, uuid: str, expect: int, who: str) -> tuple[int, StepFetch | None] | None:
        """`poll_ready`, and when the step it takes is `expect`, `fetch_step` of it with the claim `who` in
        the same round trip. None: nothing ready; (step, None): a step to fetch (not `expect`, or its
        manifest is gone: `fetch_step` says which)."""
        reply = self._poll_step(
            keys=[
                self.keys.ready(gen, uuid),
                self.keys.manifest(gen, expect, uuid),
                self.keys.claim(gen, expect, uuid),
                self.keys.gen_abort(gen),
                self.keys.step_abort(gen, expect),
            ],
            args=[str(expect), who, self.key_ttl_ms],
        )
        if not reply:
            return None
        step = int(reply[0])
        if len(reply) < 3:
            return step, None
        return step, _step_fetch(reply[1], reply[2], reply[3:5])

    @_translated
    def read_layout(self, gen: int, uuid: str, ref: str) -> bytes | None:
        return self.client.get(self.keys.layout(gen, uuid, ref))

    @_translated
    def read_manifest(self, gen: int, step: int, uuid: str) -> bytes | None:
        return self.client.get(self.keys.manifest(gen, step, uuid))

    @_translated
    def fetch_step(self, gen: int, step: int, uuid: str, who: str) -> StepFetch | None:
        """`read_manifest`, then `claim` and `abort_reason` for the step, in one round trip. None (and no
        claim) when the manifest is gone."""
        manifest, winner, gen_abort, step_abort = self._fetch_step(
            keys=[
                self.keys.manifest(gen, step, uuid),
                self.keys.claim(gen, step, uuid),
                self.keys.gen_abort(gen),
                self.keys.step_abort(gen, step),
            ],
            args=[who, self.key_ttl_ms],
        )
        if manifest is None:
            return None
        return _step_fetch(manifest, winner, [gen_abort, step_abort])

    @_translated
    def manifest_exists(self, gen: int, step: int, uuid: str) -> bool:
        return bool(self.client.exists(self.keys.manifest(gen, step, uuid)))

    @_translated
    def claim(self, gen: int, step: int, uuid: str, who: str) -> str:
        """First come wins: the reader claims before it opens; the trainer revokes before it frees early."""
        winner = self._claim(keys=[self.keys.claim(gen, step, uuid)], args=[who, self.key_ttl_ms])
        return winner.decode() if isinstance(winner, bytes) else str(winner)

    @_translated
    def claim_owner(self, gen: int, step: int, uuid: str) -> str | None:
        raw = self.client.get(self.keys.claim(gen, step, uuid))
        return None if raw is None else raw.decode()

    @_translated
    def write_ack(self, gen: int, step: int, uuid: str, ack: Ack) -> bool:
        """Write the ACK of the step this reader claimed (`ack.reader` must be the claim's value and
        `ack.proof` its proof). False: the same ACK was already there (an idempotent retry)."""
        text = ack.to_json()
        # The ACK itself is the queue's token, so the waiting writer needs no second read (see wait_ack).
        result = int(
            self._write_ack(
                keys=[
                    self.keys.ack(gen, step, uuid),
                    self.keys.ack_queue(gen, step, uuid),
                    self.keys.claim(gen, step, uuid),
                ],
                args=[text, self.key_ttl_ms, text, ack.reader, ack.proof],
            )
        )
        if result == -1:
            raw = self.client.get(self.keys.claim(gen, step, uuid))
            owner = raw.decode(errors="replace") if raw else "nobody"
            raise NotClaimant(
                f"ACK for step {step} of generation {gen} on {uuid} refused: the step is claimed by "
                f"{owner}, not by {ack.reader or 'this reader'}"
            )
        if result == 0:
            raise MetaStoreConflict(f"step {step} of generation {gen} on {uuid} was already acknowledged")
        return result != 2

    @_translated
    def wait_ack(self, gen: int, step: int, uuid: str, timeout_s: float) -> Ack | None:
        """Block at most `timeout_s` for the ACK of one step. Raises MalformedAck for one that does not
        decode (the caller reports it and keeps waiting: it is nobody's proof of a close)."""
        got = self.client.blpop([self.keys.ack_queue(gen, step, uuid)], timeout=max(timeout_s, 0.01))
        if got is not None and got[1].startswith(b"{"):
            return _ack(got[1], step)  # the token is the ACK (an older reader pushes "1": read the key)
        raw = self.client.get(self.keys.ack(gen, step, uuid))
        return None if raw is None else _ack(raw, step)

    @_translated
    def poll_ack(self, gen: int, step: int, uuid: str) -> Ack | None:
        """`wait_ack` without blocking: one LPOP, for a writer that spins through a short copy."""
        got = self.client.lpop(self.keys.ack_queue(gen, step, uuid))
        if got is None:
            return None
        if got.startswith(b"{"):
            return _ack(got, step)
        raw = self.client.get(self.keys.ack(gen, step, uuid))
        return None if raw is None else _ack(raw, step)

    @_translated
    def read_ack(self, gen: int, step: int, uuid: str) -> Ack | None:
        raw = self.client.get(self.keys.ack(gen, step, uuid))
        return None if raw is None else _ack(raw, step)

    @_translated
    def delete_steps(self, gen: int, steps: Iterable[int], uuid: str) -> int:
        keys = [k for s in steps for k in self.keys.step_keys(gen, s, uuid)]
        return int(self.client.delete(*keys)) if keys else 0

    # --- IPC preflight ------------------------------------------------------------------------------------

    @_translated
    def offer_preflight(self, gen: int, attempt: int, uuid: str, replica: int, blob: bytes) -> bool:
        """Write a preflight offer (NX), name it in the pod's index and wake the reader side."""
        result = self._offer_preflight(
            keys=[
                self.keys.preflight_offer(gen, attempt, uuid),
                self.keys.preflight_index(replica),
                self.keys.preflight_queue(uuid),
            ],
            args=[
                blob,
                self.key_ttl_ms,
                uuid,
                json.dumps({"gen": gen, "attempt": attempt}),
                f"{gen}:{attempt}",
            ],
        )
        if int(result) == 0:
            raise MetaStoreConflict(f"preflight {attempt} of generation {gen} on {uuid} already has an offer")
        return int(result) == 1

    @_translated
    def preflight_offers(self, replica: int) -> dict[str, tuple[int, int]]:
        """The newest preflight of each trainer GPU of a pod: UUID -> (gen, attempt)."""
        offers = {}
        for raw_uuid, raw in self.client.hgetall(self.keys.preflight_index(replica)).items():
            try:
                d = json.loads(raw)
                offers[raw_uuid.decode()] = (int(d["gen"]), int(d["attempt"]))
            except (ValueError, KeyError, TypeError):
                continue  # not ours to repair; the trainer overwrites it with its next attempt
        return offers

    @_translated
    def wait_preflight_offer(self, uuid: str, timeout_s: float) -> bool:
        """Block at most `timeout_s` for a new preflight offer on GPU `uuid` (a wake-up only)."""
        return self.client.blpop([self.keys.preflight_queue(uuid)], timeout=max(timeout_s, 0.01)) is not None

    @_translated
    def read_preflight_offer(self, gen: int, attempt: int, uuid: str) -> bytes | None:
        return self.client.get(self.keys.preflight_offer(gen, attempt, uuid))

    @_translated
    def claim_preflight(self, gen: int, attempt: int, uuid: str, who: str) -> str:
        """First come wins, as for steps: the reader claims before it opens; the trainer revokes late."""
        key = self.keys.preflight_claim(gen, attempt, uuid)
        winner = self._claim(keys=[key], args=[who, self.key_ttl_ms])
        return winner.decode() if isinstance(winner, bytes) else str(winner)

    @_translated
    def write_preflight_result(self, gen: int, attempt: int, uuid: str, text: str) -> bool:
        """The reader side's verdict (NX). False when a verdict is already there (another worker's)."""
        result = self._set_nx_notify(
            keys=[
                self.keys.preflight_result(gen, attempt, uuid),
                self.keys.preflight_result_queue(gen, attempt, uuid),
            ],
            args=[text, self.key_ttl_ms, "1"],
        )
        return int(result) == 1

    @_translated
    def wait_preflight_result(self, gen: int, attempt: int, uuid: str, timeout_s: float) -> bytes | None:
        """Block at most `timeout_s` for the verdict of one preflight attempt."""
        key = self.keys.preflight_result_queue(gen, attempt, uuid)
        self.client.blpop([key], timeout=max(timeout_s, 0.01))
        return self.client.get(self.keys.preflight_result(gen, attempt, uuid))

    @_translated
    def read_preflight_result(self, gen: int, attempt: int, uuid: str) -> bytes | None:
        return self.client.get(self.keys.preflight_result(gen, attempt, uuid))

    # --- events -------------------------------------------------------------------------------------------

    @_translated
    def emit(self, *events: ev.StepEvent) -> None:
        """Append step events (several in one round trip); in summary mode a GPU's finish goes to its step's
        set instead, and progress phases only from replica 0, rank 0 (contract/events.py)."""
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            if not self.summary_gpus:
                ev.xadd(pipe, self.keys.events(), event)
            elif ev.is_summarized(event):
                args = finish_args(
                    event, self.summary_gpus, self.key_ttl_ms, ev.STREAM_MAXLEN, self.keys.gen_prefix()
                )
                self._finish_step(
                    keys=[self.keys.finished(event.step), self.keys.events()], args=args, client=pipe
                )
            elif not ev.is_detail(event) or (event.replica, event.rank) == (0, 0):
                ev.xadd(pipe, self.keys.events(), event)
        if len(pipe):
            pipe.execute()

    @_translated
    def read_events(self, since: str = "-", count: int = 10_000) -> list[tuple[str, ev.StepEvent]]:
        return ev.decode_entries(self.client.xrange(self.keys.events(), min=since, count=count))
