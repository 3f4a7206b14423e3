"""How much one multiplexed XREAD may bring (the operator's peak memory follows its largest reply), and a
backlog read ahead."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from colocate_operator.observed import StreamProgress
from colocate_operator.step_stream import JobStream
from colocate_operator.steps import StepTracker
from colocate_operator.stream_reads import (
    READ_COUNT,
    READ_COUNT_MIN,
    READ_ENTRIES_MAX,
    StreamReader,
    read_count,
    stream_client,
)
from colocate_runtime.contract.events import StepEvent, decode, stream_key, xadd


@pytest.mark.parametrize("streams", [1, 2, 19, 20, 21, 100, 250, 500, 1000, 1001, 5000])
def test_a_reply_holds_at_most_the_entries_bound_or_the_floor_per_stream(streams: int) -> None:
    count = read_count(streams)
    assert READ_COUNT_MIN <= count <= READ_COUNT
    assert count * streams <= max(READ_ENTRIES_MAX, READ_COUNT_MIN * streams)


def test_a_few_jobs_read_a_full_count_and_many_share_the_bound() -> None:
    assert read_count(1) == READ_COUNT
    assert read_count(250) * 250 == READ_ENTRIES_MAX  # 8 a stream: a step of 32 GPUs in four replies
    assert read_count(0) == READ_COUNT
    assert read_count(1000) == READ_COUNT_MIN  # a step of 32 GPUs in four replies at 1000 jobs too


@pytest.mark.parametrize("protocol", [2, 3])
def test_raw_replies_decode_as_the_events_written_in_both_protocols(redis_server: Any, protocol: int) -> None:
    """A real redis-server; RESP2 sends XREAD's streams as an array, RESP3 (redis-py 8's default) as a map."""
    written = [
        StepEvent(role="trainer", gen=1, step=s, phase="finished", result="ok", gpu=f"GPU-{g}", rank=g)
        for s in (1, 2)
        for g in range(3)
    ]
    keys = [stream_key("ns", f"job-{protocol}-{i}") for i in range(2)]
    sync = redis_server.client()
    for key in keys:
        for event in written:
            xadd(sync, key, event)

    async def read() -> list[Any]:
        client = stream_client(redis_server.addr, redis_server.password, protocol=protocol)
        try:
            return await client.xread({key: "0-0" for key in keys}, count=100)
        finally:
            await client.aclose()

    reply = asyncio.run(read())
    assert sorted(stream.decode() for stream, _ in reply) == sorted(keys)
    for _, entries in reply:
        assert all(isinstance(fields, list) for _, fields in entries), "no dict per entry"
        read = [decode(fields) for _, fields in entries]
        assert read == [dataclasses.replace(e, ts=r.ts) for e, r in zip(written, read, strict=True)]


def test_a_backlog_is_read_ahead_and_every_entry_arrives_once_in_order(redis_server: Any) -> None:
    """Streams holding more than one read's count: the next read goes out before the last reply is handed
    out (the store serves it while the operator decodes), and each job still gets every step once, in order,
    and ends where its stream ends."""
    jobs, steps, gpus = 6, 40, 4  # 160 entries a stream: several reads of READ_COUNT
    sync = redis_server.client()
    keys = [stream_key("ns", f"ahead-{i}") for i in range(jobs)]
    for key in keys:
        pipe = sync.pipeline(transaction=False)
        for step in range(1, steps + 1):
            for g in range(gpus):
                event = StepEvent(
                    role="trainer", gen=1, step=step, phase="finished", result="ok", gpu=f"G{g}"
                )
                xadd(pipe, key, event)
        pipe.execute()

    async def follow_all() -> tuple[list[JobStream], StreamReader]:
        closed: list[StreamReader] = []
        reader = StreamReader(redis_server.addr, redis_server.password, closed.append)
        streams = [
            JobStream("ns", key, None, key, StepTracker(expected_gpus=gpus), StreamProgress()) for key in keys
        ]
        for follow in streams:
            reader.attach(follow)
        deadline = time.monotonic() + 30
        while any(f.tracker.last_completed_step != steps for f in streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for follow in streams:
            reader.detach(follow)
        await asyncio.sleep(0.1)
        return streams, reader

    streams, reader = asyncio.run(follow_all())
    for follow, key in zip(streams, keys, strict=True):
        assert follow.tracker.last_completed_step == steps
        assert [r.step for r in follow.tracker.recent][-3:] == [steps - 2, steps - 1, steps]
        assert follow.boundaries == steps, "every step completed once"
        assert follow.skips.count == 0
        assert follow.last_id == sync.xinfo_stream(key)["last-generated-id"].decode()
    assert reader.xreads >= jobs * steps * gpus // (READ_COUNT * jobs), "the backlog took several reads"
    assert reader.reads_ahead > 0, "a read went out before the last reply was handed out"
    assert reader.closed and reader._next is None
