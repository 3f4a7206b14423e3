"""The operator's step reader alone, in one process against a real redis-server (issue 35): N jobs' streams
filled with S steps of the scale bench's entries (bench/scale/steps.py: in summary mode, as the operator's
pods write them, one `completed` record a job and step made by the runtime's script from its 32 GPUs'
finishes; with --detailed, the 32 `finished` records), then read by one StreamReader into N trackers until
every job has completed its last step. No API server: what is measured is reading, decoding and folding.

    python -m bench.scale.stream_bench --jobs 1000 --steps 10

prints one JSON line: entries, wall seconds, the process's CPU seconds and Redis's, per entry and per GPU
finish (Redis's per finish includes the summary script's run when filling). To compare with another
commit's operator, run it with that commit's packages first on the path (`--source` names a checkout: its
runtime/, operator/ and devcluster/ are linked into a temporary directory put first on sys.path before
anything is imported), interleaving the two; a checkout from before summary mode needs --detailed."""

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


def _fill(server: Any, jobs: list[str], steps: int, summary: bool) -> float:
    """The streams of `steps` steps of every job, as the scale bench's emitter writes them; Redis's CPU
    seconds for it (in summary mode the runtime's script runs for each GPU there)."""
    from bench.scale.steps import Emitter

    client = server.client(socket_timeout=60)
    emitter = Emitter(server, "bench", jobs, PODS, GPUS_PER_POD, records="gpu" if summary else "detailed")
    before = _redis_cpu(client)
    for _ in range(steps):
        emitter.emit_round(client)
    return _redis_cpu(client) - before


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
    parser.add_argument(
        "--detailed",
        action="store_true",
        help="one record a GPU and step (a runtime without COLOCATE_STEP_SUMMARY_GPUS), not summary mode",
    )
    args = parser.parse_args(argv)
    if args.source is not None:
        _use_source(args.source.resolve())
    import colocate_operator
    from colocate_devcluster.localredis import RedisServer
    from colocate_runtime.contract.events import stream_key

    jobs = [f"job-{i}" for i in range(args.jobs)]
    keys = [stream_key("bench", job) for job in jobs]
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as work:
        server = RedisServer(Path(work)).start()
        try:
            fill_cpu = _fill(server, jobs, args.steps, not args.detailed)
            client = server.client()
            redis_cpu = _redis_cpu(client)
            result = asyncio.run(_follow(server, keys, args.steps, args.timeout))
            result["redis_cpu_s"] = _redis_cpu(client) - redis_cpu
        finally:
            server.stop()
    finishes = args.jobs * args.steps * PODS * GPUS_PER_POD  # one a GPU and step, in either mode
    entries = finishes if args.detailed else args.jobs * args.steps
    result.update(
        mode="detailed" if args.detailed else "summary",
        entries=entries,
        us_per_finish_cpu=1e6 * result["cpu_s"] / finishes,
        us_per_finish_redis=1e6 * (result["redis_cpu_s"] + fill_cpu) / finishes,
        redis_fill_cpu_s=fill_cpu,
        us_per_entry_cpu=1e6 * result["cpu_s"] / entries,
        us_per_entry_redis=1e6 * result["redis_cpu_s"] / entries,
        source=str(Path(colocate_operator.__file__).resolve().parent),
        load=os.getloadavg()[0],
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
