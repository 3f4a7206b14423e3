"""What the operator reads from a job's meta-store is bounded, and how long it waits for it (review issue 30,
items 1 and 2), against a real redis-server: the step follower's bounded read and its wait for new entries,
the checkpoint records' read, and the checkpoint I/O that a paused store must not hold on a shared worker.
Memory is measured with tracemalloc, which sees every Python object a reply becomes (the huge values are
written from a separate connection before it starts)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import threading
import time
import tracemalloc
from typing import Any

import pytest
import redis

from colocate_devcluster.localredis import RedisServer
from colocate_operator import checkpoints, kube
from colocate_operator.config import OperatorConfig
from colocate_operator.decide import CheckpointWrite
from colocate_operator.observed import CheckpointState, Observed, PodState
from colocate_operator.step_stream import ENTRY_MAX_BYTES
from colocate_operator.stream_reads import READ_BYTES_MAX, STREAM_READ_SCRIPT, Bell
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.checkpoint import CheckpointKeys
from colocate_runtime.contract.events import ENTRY_MAX_FIELDS, StepEvent, decode, xadd
from tests.operator import factories

pytestmark = pytest.mark.timeout(120)
HUGE = 48 * 2**20
KEY = "colocate:ns:job:events"
LATE_WRITER = (
    "import sys, time, redis; time.sleep(0.5); "
    "redis.Redis(port=int(sys.argv[1]), password=sys.argv[2]).xadd(sys.argv[3], {{'blob': b'x' * {size}}})"
)


def bounded_read(client: redis.Redis, last: str = "0-0", count: int = 100) -> list[Any]:
    ((last_id, kept, skipped, more),) = client.eval(
        STREAM_READ_SCRIPT,
        1,
        KEY,
        count,
        ENTRY_MAX_BYTES,
        ENTRY_MAX_FIELDS,
        READ_BYTES_MAX,
        last,
    )
    return [last_id, kept, skipped, more]


def fields_of(kept: bytes | list[bytes]) -> list[bytes]:
    """A kept entry's keys and values (the read joins them by NUL where none holds one)."""
    return kept.split(b"\0") if isinstance(kept, bytes) else kept


def event(step: int) -> StepEvent:
    return StepEvent(role="trainer", gen=1, step=step, phase="finished", result="ok", gpu="GPU-a")


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_bounded_read_leaves_huge_entries_in_the_store_and_moves_past_them(
    redis_server: RedisServer, protocol: int
) -> None:
    writer = redis_server.client()
    xadd(writer, KEY, event(1))
    for i in range(3):
        writer.xadd(KEY, {"blob": bytes([65 + i]) * HUGE})
    writer.xadd(KEY, {f"k{i}": "v" for i in range(ENTRY_MAX_FIELDS + 1)})  # small, but too many fields
    last_written = xadd(writer, KEY, event(2))
    reader = redis.Redis(
        host=redis_server.host, port=redis_server.port, password=redis_server.password, protocol=protocol
    )
    tracemalloc.start()
    try:
        last_id, kept, skipped, more = bounded_read(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"reading past {3 * HUGE} bytes of entries took {peak / 2**20:.1f} MiB"
    assert [decode(fields_of(fields)).step for _, fields in kept] == [1, 2]
    many_fields = sum(len(f"k{i}") + 1 for i in range(ENTRY_MAX_FIELDS + 1))
    assert [int(size) for _, size in skipped] == [HUGE + len("blob")] * 3 + [many_fields]
    assert last_id == (last_written.encode() if isinstance(last_written, str) else last_written)
    assert more == 0
    assert bounded_read(reader, last_id.decode()) == [last_id, [], [], 0], "nothing is read twice"


def test_entries_come_joined_unless_a_field_holds_a_nul_and_decode_alike(redis_server: RedisServer) -> None:
    """The read joins an entry's keys and values by NUL where none holds one (one string for the operator to
    parse); an entry holding one comes as XRANGE has it. Either decodes, or is refused, as `decode` does the
    entry's own fields."""
    writer = redis_server.client()
    plain = ev.encode(event(1))
    written = [
        plain,
        {**plain, "gpu": "GPU-\0-a"},  # a NUL: not joined, and still a step event
        {**plain, "step": "\0"},  # a NUL: not joined, refused as a malformed number
        {**plain, "error": "e" * 1500},  # joined, refused for its length
        {**plain, "gpu": "GPU-\u00e9"},  # joined, not ASCII
    ]
    for fields in written:
        writer.xadd(KEY, fields)
    _, kept, _, _ = bounded_read(writer)
    assert [isinstance(fields, bytes) for _, fields in kept] == [True, False, False, True, True]

    def outcome(fields: dict[str, str] | bytes | list[bytes]) -> object:
        try:
            return ev.decode_joined(fields) if isinstance(fields, bytes) else ev.decode(fields)  # type: ignore[arg-type]
        except ev.EventError as e:
            return str(e)

    assert [outcome(fields) for _, fields in kept] == [outcome(fields) for fields in written]
    assert isinstance(outcome(kept[1][1]), ev.StepEvent) and isinstance(outcome(kept[3][1]), str)


def test_a_reply_stops_at_its_byte_bound_and_says_more_follows(redis_server: RedisServer) -> None:
    writer = redis_server.client()
    entry = {f"k{i:02}": "v" * 1000 for i in range(ENTRY_MAX_FIELDS)}  # within bounds, about 32 KB
    size = sum(len(k) + len(v) for k, v in entry.items())
    total = READ_BYTES_MAX // size + 10
    pipe = writer.pipeline(transaction=False)
    for _ in range(total):
        pipe.xadd(KEY, entry)
    pipe.execute()
    read, last, rounds = 0, "0-0", 0
    while True:
        last_id, kept, skipped, more = bounded_read(writer, last, count=1000)
        assert sum(len(f) for _, fields in kept for f in fields_of(fields)) <= READ_BYTES_MAX and not skipped
        read, last, rounds = read + len(kept), last_id.decode(), rounds + 1
        if not more:
            break
    assert read == total and rounds == 2


def test_the_bell_wakes_on_a_new_entry_without_reading_it(redis_server: RedisServer) -> None:
    writer = redis_server.client()
    last = xadd(writer, KEY, event(1))
    last = last.decode() if isinstance(last, bytes) else last

    async def scenario() -> tuple[float, float, int]:
        bell = Bell(redis_server.addr, redis_server.password)
        try:
            began = time.monotonic()
            await bell.wait({KEY: last}, 0.3)  # nothing new: its block runs out
            idle = time.monotonic() - began
            assert bell.skips is True
            # Written by another process half a second from now: this one never holds the entry.
            late = LATE_WRITER.format(size=HUGE)
            args = [str(redis_server.port), redis_server.password, KEY]
            writer_process = subprocess.Popen([sys.executable, "-c", late, *args])
            tracemalloc.start()
            began = time.monotonic()
            await bell.wait({KEY: last}, 10)
            woke = time.monotonic() - began
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert writer_process.wait(10) == 0
            return idle, woke, peak
        finally:
            await bell.close()

    idle, woke, peak = asyncio.run(scenario())
    assert 0.25 < idle < 2
    assert 0.4 < woke < 5, f"woke after {woke:.1f} s"
    assert peak < 2**20, f"waiting for a {HUGE}-byte entry took {peak / 2**20:.1f} MiB"


def test_a_store_refusing_client_reply_is_polled(redis_server: RedisServer) -> None:
    redis_server.client().execute_command("ACL", "SETUSER", "default", "-client")

    async def scenario() -> tuple[bool | None, float]:
        bell = Bell(redis_server.addr, redis_server.password)
        try:
            began = time.monotonic()
            await bell.wait({KEY: "0-0"}, 30)
            return bell.skips, time.monotonic() - began
        finally:
            await bell.close()

    skips, waited = asyncio.run(scenario())
    assert skips is False and waited < 3, "a poll interval, not the whole block"


def test_checkpoint_records_over_their_bounds_are_never_sent(redis_server: RedisServer) -> None:
    keys = CheckpointKeys("ns", "job")
    writer = redis_server.client()
    writer.hset(keys.ranks, mapping={"0": "1", "1": "1", "r" * HUGE: "1"})
    writer.set(keys.request, b"{" * HUGE)
    writer.hset(keys.acks, mapping={"0": '{"id": "r1", "step": 4}', "1": b"x" * HUGE, "k" * HUGE: "{}"})
    reader = redis_server.client()
    tracemalloc.start()
    try:
        seen = checkpoints.read(reader, keys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"reading the records took {peak / 2**20:.1f} MiB"
    assert seen == CheckpointState(readable=True, ranks=frozenset({"0", "1"}), acks={"0": ("r1", 4)})


class SecretOnly(kube.Kube):
    def __init__(self, password: str) -> None:
        self.data = {"password": base64.b64encode(password.encode()).decode()}

    def get(self, kind: kube.Kind, namespace: str | None, name: str, **_: Any) -> dict[str, Any] | None:
        return {"metadata": {"name": name}, "data": self.data} if kind is kube.SECRETS else None


def test_a_paused_store_holds_a_pass_at_most_the_wait_and_its_answer_queues_the_job(
    redis_server: RedisServer,
) -> None:
    config = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})
    store = {
        "mode": "External",
        "external": {"address": redis_server.addr, "passwordSecretRef": {"name": "s"}},
    }
    job = factories.job(suspend=True, metaStore=store, runPolicy={"suspendGracePeriodSeconds": 60})
    pod = PodState("demo-0", "p0", 0, 0, True, "Running", False, True, True)
    observed = Observed(pods=(pod,))
    status = {"phase": "Running"}
    queued = threading.Event()
    io = checkpoints.CheckpointIO(SecretOnly(redis_server.password), config, lambda ns, name: queued.set())
    try:
        assert io.observe(job, status, observed).checkpoint == CheckpointState(readable=True)
        redis_server.client().execute_command("CLIENT", "PAUSE", 60_000, "ALL")
        began = time.monotonic()
        first = io.observe(job, status, observed).checkpoint
        held = time.monotonic() - began
        assert first == CheckpointState(readable=True), "the last answer while the new read is on its way"
        assert held < checkpoints.WAIT_SECONDS + 0.3, f"the pass waited {held:.2f} s"
        began = time.monotonic()
        again = io.observe(job, status, observed).checkpoint
        assert time.monotonic() - began < 0.1, "an operation in flight is not waited for twice"
        assert again == first
        assert queued.wait(10), "the read's end queues the job"
        answered = time.monotonic() - began
        assert answered < 3 * checkpoints.TIMEOUT_SECONDS + 1, f"the read took {answered:.1f} s"
        assert io.observe(job, status, observed).checkpoint == CheckpointState(readable=False)
        began = time.monotonic()  # the next read of a store that did not answer is not waited for at all
        assert io.observe(job, status, observed).checkpoint == CheckpointState(readable=False)
        assert time.monotonic() - began < 0.1
        began = time.monotonic()
        with pytest.raises(checkpoints.CheckpointUnavailable):
            while not io.execute(job, CheckpointWrite(request_id="r", reason="t")):
                assert time.monotonic() - began < 10
                time.sleep(0.2)
    finally:
        io.close()
