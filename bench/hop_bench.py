"""The colocated protocol's fixed cost per step without any payload: the meta-store hops of one step, timed
as a step makes them, after an idle gap between steps (a real step follows seconds of training).

Two processes on a real redis-server, through the runtime's own `MetaStore` calls: the trainer publishes a
manifest (`publish_manifest`: SET NX + notify), the reader, blocked in `pop_ready`, wakes, fetches and claims
the step (`fetch_step`), writes its ACK (`write_ack`), and the trainer, blocked in `wait_ack`, holds it. No
GPU and no copy: what is left is the part of a weight-sync step the copy floor does not cover.

    python -m bench.hop_bench --steps 200 --gaps-ms 0 1 10 100

Per gap it prints the median and 90th percentile of each hop (ms, both processes on one monotonic clock):
publish (the trainer's script call), wake (publish start to the reader's pop_ready return), fetch, ack (the
reader's script call), held (the reader's ACK start to the trainer's wait_ack return), and the whole chain.
A gap of 0 is a tight loop: every process and the server stay on a busy core. Linux only (CLOCK_MONOTONIC is
shared by processes).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import MetaStore, reader_identity, step_claim

GPU = "GPU-hop-bench"
GEN = 1
MANIFEST_BYTES = 2048  # an in-place manifest that names its layout by reference is about this size
TIMEOUT_S = 30.0


def _proof(gen: int, step: int) -> str:
    return hmac.new(b"hop-bench", f"{GPU}:{gen}:{step}".encode(), hashlib.sha256).hexdigest()[:32]


def _reader(address: MetaStoreAddress, steps: int, out: mp.Queue) -> None:
    store = MetaStore.connect(address, KeySchema("bench", "hops"))
    identity = reader_identity("bench", 1, "hop")
    marks = []
    for _ in range(steps):
        step = store.pop_ready(GEN, GPU, TIMEOUT_S)
        woke = time.perf_counter()
        if step is None:
            raise SystemExit("reader: no step published within 30 s")
        claim = step_claim(identity, _proof(GEN, step))
        fetched = store.fetch_step(GEN, step, GPU, claim)
        fetched_at = time.perf_counter()
        if fetched is None or fetched.winner != claim:
            raise SystemExit(f"reader: step {step} not fetched and claimed")
        ack = Ack(status="ok", ipc_closed=True, reader=claim, proof=_proof(GEN, step), opened=(), held=())
        store.write_ack(GEN, step, GPU, ack)
        marks.append((step, woke, fetched_at, time.perf_counter()))
    out.put(marks)


def _run(address: MetaStoreAddress, steps: int, gap_s: float) -> dict[str, list[float]]:
    store = MetaStore.connect(address, KeySchema("bench", "hops"))
    store.delete_steps(GEN, range(steps), GPU)
    out: mp.Queue = mp.Queue()
    reader = mp.Process(target=_reader, args=(address, steps, out), daemon=True)
    reader.start()
    blob = b"m" * MANIFEST_BYTES
    trainer = []
    try:
        time.sleep(0.5)  # the reader is blocked in pop_ready
        for step in range(steps):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            store.publish_manifest(GEN, step, GPU, blob)
            t1 = time.perf_counter()
            if store.wait_ack(GEN, step, GPU, TIMEOUT_S) is None:
                raise SystemExit(f"trainer: no ACK for step {step} within 30 s")
            trainer.append((t0, t1, time.perf_counter()))
        marks = out.get(timeout=TIMEOUT_S)
    finally:
        reader.join(5)
        if reader.is_alive():
            reader.kill()
        store.delete_steps(GEN, range(steps), GPU)
        store.close()
    hops: dict[str, list[float]] = {k: [] for k in ("publish", "wake", "fetch", "ack", "held", "chain")}
    for (t0, t1, t2), (_, woke, fetched, acked) in zip(trainer, marks, strict=True):
        ack_start = fetched
        for key, value in (
            ("publish", t1 - t0),
            ("wake", woke - t0),
            ("fetch", fetched - woke),
            ("ack", acked - ack_start),
            ("held", t2 - ack_start),
            ("chain", t2 - t0),
        ):
            hops[key].append(value * 1e3)
    return hops


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per gap (the first 10 are not counted)")
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 1.0, 10.0, 100.0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.steps <= 10:
        parser.error("--steps must be more than 10 (the first 10 warm up)")
    results = []
    with tempfile.TemporaryDirectory(prefix="hop-bench-") as workdir:
        server = RedisServer(Path(workdir)).start()
        try:
            address = MetaStoreAddress(server.host, server.port, server.password)
            print(f"# {args.steps} steps per gap, {MANIFEST_BYTES} B manifest; ms, median / p90", flush=True)
            print("| idle gap ms | publish | wake | fetch | ack | held | whole chain |")
            print("|---|---|---|---|---|---|---|")
            for gap in args.gaps_ms:
                hops = _run(address, args.steps, gap / 1e3)
                cells = {k: (statistics.median(v[10:]), _quantile(v[10:], 0.9)) for k, v in hops.items()}
                results.append({"gap_ms": gap, **{k: {"p50": a, "p90": b} for k, (a, b) in cells.items()}})
                row = " | ".join(f"{a:.3f} / {b:.3f}" for a, b in cells.values())
                print(f"| {gap:g} | {row} |", flush=True)
        finally:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
