"""The operator's step reader alone, in one process against a real redis-server (issue 35): N jobs' streams
filled with S steps of the scale bench's entries (bench/scale/steps.py: 32 trainer `finished` records a job
and step), then read by one StreamReader into N trackers until every job has completed its last step. No
API server: what is measured is reading, decoding and folding, the operator's cost per entry.

    python -m bench.scale.stream_bench --jobs 1000 --steps 10

prints one JSON line: entries, wall seconds, the process's CPU seconds and Redis's, per entry. To compare
with another commit's operator, run it with that commit's packages first on the path (`--source` names a
checkout: its runtime/, operator/ and devcluster/ are linked into a temporary directory put first on
sys.path before anything is imported), interleaving the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GPUS_PER_POD, PODS = 8, 4


def _use_source(checkout: Path) -> None:
    """Put `checkout`'s packages first on sys.path (before the editable install, which maps to this tree)."""
    links = Path(tempfile.mkdtemp(prefix="stream-bench-src-"))
    for name, rel in (
        ("colocate_runtime", "runtime"),
        ("colocate_operator", "operator/colocate_operator"),
        ("colocate_devcluster", "devcluster"),
    ):
        (links / name).symlink_to(checkout / rel)
    sys.path.insert(0, str(links))


def _redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _fill(server: Any, keys: list[str], steps: int) -> None:
    from bench.scale.steps import EMIT_STEP
    from colocate_runtime.contract.events import STREAM_MAXLEN

    client = server.client(socket_timeout=60)
    script = client.register_script(EMIT_STEP)
    for step in range(1, steps + 1):
        pipe = client.pipeline(transaction=False)
        for key in keys:
            args = [str(step), f"{time.time():.6f}", PODS, GPUS_PER_POD, STREAM_MAXLEN]
            script(keys=[key], args=args, client=pipe)
        pipe.execute()


async def _follow(server: Any, keys: list[str], steps: int, timeout: float) -> dict[str, float]:
    from colocate_operator.observed import StreamProgress
    from colocate_operator.step_stream import JobStream
    from colocate_operator.steps import StepTracker
    from colocate_operator.stream_reads import StreamReader

    reader = StreamReader(server.addr, server.password, lambda _: None)
    streams = [
        JobStream("bench", key, None, key, StepTracker(expected_gpus=PODS * GPUS_PER_POD), StreamProgress())
        for key in keys
    ]
    started, cpu = time.monotonic(), time.process_time()
    for follow in streams:
        reader.attach(follow)
    deadline = started + timeout
    while any(f.tracker.last_completed_step != steps for f in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not caught up after {timeout:.0f} s")
        await asyncio.sleep(0.01)
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    for follow in streams:
        reader.detach(follow)
    await asyncio.sleep(0.1)
    skipped = sum(f.skips.count + f.skips.oversized for f in streams)
    return {"wall_s": wall, "cpu_s": cpu, "xreads": reader.xreads, "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--source", type=Path, help="a checkout whose operator and runtime to measure")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.source is not None:
        _use_source(args.source.resolve())
    import colocate_operator
    from colocate_devcluster.localredis import RedisServer
    from colocate_runtime.contract.events import stream_key

    keys = [stream_key("bench", f"job-{i}") for i in range(args.jobs)]
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as work:
        server = RedisServer(Path(work)).start()
        try:
            _fill(server, keys, args.steps)
            client = server.client()
            redis_cpu = _redis_cpu(client)
            result = asyncio.run(_follow(server, keys, args.steps, args.timeout))
            result["redis_cpu_s"] = _redis_cpu(client) - redis_cpu
        finally:
            server.stop()
    entries = args.jobs * args.steps * PODS * GPUS_PER_POD
    result.update(
        entries=entries,
        us_per_entry_cpu=1e6 * result["cpu_s"] / entries,
        us_per_entry_redis=1e6 * result["redis_cpu_s"] / entries,
        source=str(Path(colocate_operator.__file__).resolve().parent),
        load=os.getloadavg()[0],
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
