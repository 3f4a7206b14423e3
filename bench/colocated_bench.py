"""Colocated weight update, one GPU: publish -> open -> copy -> verified close -> ACK, through a real Redis.

Compares three ways of moving the same bf16 weights from a trainer process to an inference process on the
same GPU: ours (dtype-grouped buckets, verified close), per-tensor IPC handles (one bucket per tensor, the
failure mode of AWEX before its PR 113), and ours with a blanket `gc.collect()` at close (AWEX PR 112).
The inference process keeps a synthetic Python heap (`--heap-objects`) so that a collection costs what it
costs in a serving process. Prints the median of the timed steps (after one warm-up) per phase, and the
command that reproduces the run.

  python bench/colocated_bench.py --size-gb 8 16              # on an H200 (needs redis-server)
  python bench/colocated_bench.py --device cpu --size-gb 0.05 # smoke test on CPU (shared memory)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import runtime_path  # noqa: F401  (maps colocate_runtime and colocate_devcluster onto this checkout)
from call_trace import CallTrace, timeline

from colocate_devcluster.localredis import RedisServer, redis_binary

REPO = Path(__file__).resolve().parents[1]
MODES = ("grouped", "per_tensor", "blanket_gc", "in_place", "in_place_kept")
HIDDEN = 4096


def shapes(size_bytes: int, tensors: int) -> list[tuple[int, int]]:
    rows = max(1, size_bytes // (tensors * HIDDEN * 2))
    return [(rows, HIDDEN)] * tensors


def start_redis(workdir: Path) -> RedisServer:
    if redis_binary() is None:
        sys.exit("redis-server not found: install it or set COLOCATE_REDIS_SERVER")
    return RedisServer(workdir).start()


def env_for(args: argparse.Namespace, port: int, password: str, mode: str, shm: Path) -> dict[str, str]:
    return {
        "COLOCATE_JOB_NAME": "bench",
        "COLOCATE_NAMESPACE": "bench",
        "COLOCATE_METASTORE_ADDR": f"127.0.0.1:{port}",
        "COLOCATE_METASTORE_PASSWORD": password,
        "COLOCATE_TRANSPORT": "CudaIPC" if args.device == "cuda" else "SharedMemory",
        "COLOCATE_SHM_DIR": str(shm),
        "COLOCATE_BUCKET_MB": str(args.bucket_mb),
        "COLOCATE_STEP_TIMEOUT_SECONDS": "300",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "10",
        # The spins (contract/env.py) are the runtime's defaults unless the caller sets them.
        **{k: os.environ[k] for k in ("COLOCATE_ACK_SPIN_MS", "COLOCATE_READY_SPIN_MS") if k in os.environ},
    }


# --- inference side ---------------------------------------------------------------------------------------


def copy_floor(targets: dict) -> dict[str, float]:
    """Device-to-device copies of the same bytes, no IPC, timed like the copy phase (host clock, ending with a
    sync), best of five: `flat` one copy of the whole payload between two flat buffers (the floor of the copy
    phase: what the memory can do), `loop` one copy_ per tensor from a flat buffer into the targets (the
    floor the earlier table printed, itself 25-35% over `flat`)."""
    import torch

    total = sum(t.numel() for t in targets.values())
    flat = torch.empty(total, dtype=torch.bfloat16, device="cuda:0")
    flat.view(torch.int16).random_()
    twin = torch.empty_like(flat)
    views, offset = [], 0
    for t in targets.values():
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    dsts = list(targets.values())
    result = {}
    for name in ("flat", "loop"):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "flat":
                twin.copy_(flat)
            else:
                for d, v in zip(dsts, views, strict=True):
                    d.copy_(v)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        result[name] = best
    del views, flat, twin
    torch.cuda.empty_cache()
    return result


def run_reader(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.reader import ReaderBenchSwitches
    from colocate_runtime.colocated.wiring import new_reader

    cfg = ColocateConfig.from_env(os.environ)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    heap = [{"i": i, "t": (i, str(i))} for i in range(args.heap_objects)]  # a serving process's heap
    targets = {
        f"layers.{i}.weight": torch.zeros(s, dtype=torch.bfloat16, device=device)
        for i, s in enumerate(shapes(int(args.size_gb * 1e9), args.tensors))
    }
    reader = new_reader(cfg, targets, device=0 if args.device == "cuda" else None)
    reader.settings = dataclasses.replace(reader.settings, verify_checksums=False)
    reader.use_bench_switches(
        ReaderBenchSwitches(
            blanket_gc=args.mode == "blanket_gc",
            copy_kernel=args.reader_copy == "kernel",
            overlap_open=not args.serial_open,
        )
    )
    floor = None
    if args.device == "cuda":
        floor = copy_floor(targets)
    trace = trace_reader(reader) if args.trace else None
    out = []
    spins = args.ready_spin_ms or [reader.settings.ready_spin_s * 1e3]
    for step in range(1, args.steps + 1):
        # Alternating with the writer's step (a paired comparison, as --ack-spin-ms).
        reader.settings = dataclasses.replace(reader.settings, ready_spin_s=spins[step % len(spins)] / 1e3)
        report = reader.apply_next(timeout_s=300)
        out.append({"step": report.step, "seconds": report.phase_seconds, "gc": report.gc_fallback})
    reader.close()
    spans = trace.spans if trace is not None else []
    print(json.dumps({"reader": out, "d2d_floor_s": floor, "heap": len(heap), "spans": spans}), flush=True)


def trace_reader(reader) -> CallTrace:  # type: ignore[no-untyped-def]
    """--trace: the reader's calls of a step, each timed (call_trace.py)."""
    from colocate_runtime.colocated import reader as reader_module
    from colocate_runtime.colocated.close import ImportScope
    from colocate_runtime.colocated.reader_program import CopyProgram

    trace = CallTrace()
    for attr in ("current_gen", "abort_reason", "poll_ready", "pop_ready", "fetch_step", "write_ack"):
        trace.wrap(reader.store, attr, f"reader {attr}")
    trace.wrap(reader_module, "decode_manifest", "reader decode_manifest")
    trace.wrap(reader._kept, "hold", "reader kept.hold")
    trace.wrap(reader, "_program", "reader copy program")
    trace.wrap(reader.importer, "open", "reader open")
    trace.wrap(reader.importer, "synchronize", "reader synchronize")
    trace.wrap(CopyProgram, "copy_bucket", "reader launch copy")
    trace.wrap(ImportScope, "close", "reader close")
    trace.wrap(reader, "_emit", "reader step events")
    return trace


def trace_writer(writer) -> CallTrace:  # type: ignore[no-untyped-def]
    """--trace: the trainer's calls of a step, each timed (call_trace.py)."""
    from colocate_runtime.colocated import writer as writer_module
    from colocate_runtime.colocated.inplace import InPlaceLayout

    trace = CallTrace()
    trace.wrap(InPlaceLayout, "stage", "trainer stage (alias)")
    trace.wrap(writer.exporter, "export", "trainer export")
    trace.wrap(writer.exporter, "synchronize", "trainer synchronize")
    trace.wrap(writer_module, "encode_manifest", "trainer encode manifest")
    trace.wrap(writer.store, "publish_manifest", "trainer publish script")
    trace.wrap(writer.store, "poll_ack", "trainer poll_ack")
    trace.wrap(writer.store, "wait_ack", "trainer wait_ack")
    return trace


def copy_methods(args: argparse.Namespace) -> None:
    """Ways to copy one step's buckets into separately allocated parameters, no IPC and no protocol: the
    floor of the copy phase and what each method leaves above it. Device-event and host wall times, median of
    `--reps`; each method is checked bitwise on poisoned targets first."""
    import ctypes

    import torch

    from colocate_runtime.colocated import fastcopy
    from colocate_runtime.colocated.buckets import EntrySpec, plan_buckets

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    size = int(args.size_gb[0] * 1e9)
    shp = shapes(size, args.tensors)
    plan = plan_buckets([EntrySpec(f"t{i}", "bfloat16", s) for i, s in enumerate(shp)], args.bucket_mb << 20)
    buckets = []
    for b in plan.buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=dev)
        buf.view(torch.int32)[: b.nbytes // 4].random_()  # random payload: zeros can copy faster
        buckets.append(buf)
    targets = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shp]  # one allocation each
    entries = plan.entries
    payload = plan.payload_bytes
    by_bucket: dict[int, list] = {}
    for e, t in zip(entries, targets, strict=True):
        by_bucket.setdefault(e.bucket, []).append((e, t))
    # Sources as the reader makes them: per bucket one split of the bf16 view.
    srcs, dsts = [], []
    for bi, items in by_bucket.items():
        for e, t in items:
            srcs.append(buckets[bi][e.offset : e.offset + e.nbytes].view(torch.bfloat16).view(e.shape))
            dsts.append(t)
    flat_a = torch.empty(payload, dtype=torch.uint8, device=dev)
    flat_a[: payload // 4 * 4].view(torch.int32).random_()
    flat_b = torch.empty_like(flat_a)
    contiguous = torch.empty(sum(b.nbytes for b in plan.buckets), dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream() for _ in range(4)]

    def loop() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    def loop_u8() -> None:
        for e, t in ((e, t) for items in by_bucket.values() for e, t in items):
            t.view(-1).view(torch.uint8).copy_(buckets[e.bucket][e.offset : e.offset + e.nbytes])

    def split_loop() -> None:  # exactly the reader's old path: one split per bucket, then copy_
        for bi, items in by_bucket.items():
            sizes, pos, order = [], 0, []
            for e, t in items:
                start = e.offset // 2
                if start > pos:
                    sizes.append(start - pos)
                order.append((len(sizes), t.view(-1)))
                sizes.append(e.nbytes // 2)
                pos = start + e.nbytes // 2
            if pos < buckets[bi].numel() // 2:
                sizes.append(buckets[bi].numel() // 2 - pos)
            chunks = buckets[bi].view(torch.bfloat16).split(sizes)
            for i, d in order:
                d.copy_(chunks[i])

    def multi_stream(n: int):  # type: ignore[no-untyped-def]
        def run() -> None:
            cur = torch.cuda.current_stream()
            for s in streams[:n]:
                s.wait_stream(cur)
            for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
                with torch.cuda.stream(streams[i % n]):
                    d.copy_(s)
            for s in streams[:n]:
                cur.wait_stream(s)

        return run

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs)

    def flat() -> None:
        flat_b.copy_(flat_a)

    def per_bucket_contiguous() -> None:  # targets laid out back to back in bucket order: one copy a bucket
        pos = 0
        for b in buckets:
            contiguous[pos : pos + b.numel()].copy_(b)
            pos += b.numel()

    methods = {
        "one flat copy (ceiling)": (flat, None),
        "one copy per bucket, contiguous targets": (per_bucket_contiguous, None),
        "copy_ per tensor, split (old reader)": (split_loop, "dst"),
        "copy_ per tensor, bf16 views": (loop, "dst"),
        "copy_ per tensor, uint8 views": (loop_u8, "dst"),
        "_foreach_copy_": (foreach, "dst"),
        "copy_ per tensor over 2 streams": (multi_stream(2), "dst"),
        "copy_ per tensor over 4 streams": (multi_stream(4), "dst"),
    }
    cudart = None
    with open("/proc/self/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "libcudart.so" in line]
    if loaded:
        cudart = ctypes.CDLL(loaded[0])
    if cudart is not None:
        cudart.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        ptrs = [(d.data_ptr(), s.data_ptr(), d.numel() * 2) for d, s in zip(dsts, srcs, strict=True)]

        def raw() -> None:
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            fn = cudart.cudaMemcpyAsync
            for d, s, n in ptrs:
                if fn(d, s, n, 3, stream) != 0:
                    raise RuntimeError("cudaMemcpyAsync failed")

        methods["cudaMemcpyAsync per tensor (ctypes)"] = (raw, "dst")
    if fastcopy.available(dev):
        kib = 1 << 10
        for tile, block, warps in (
            (64 * kib, 64 * kib, 8),  # the reader's (fastcopy.py)
            (128 * kib, 64 * kib, 8),
            (256 * kib, 64 * kib, 8),
            (512 * kib, 64 * kib, 8),
            (128 * kib, 64 * kib, 16),
            (256 * kib, 128 * kib, 16),
            (64 * kib, 32 * kib, 4),
        ):
            tables = []
            for bi, items in by_bucket.items():
                copies = [(e.offset, t, e.nbytes) for e, t in items]
                tables.append((bi, fastcopy.build(copies, dev, block=block, warps=warps, tile=tile)))

            def tri(tables=tables) -> None:  # type: ignore[no-untyped-def]
                for bi, table in tables:
                    table.launch(buckets[bi])

            methods[f"triton tiles {tile >> 10}K, block {block >> 10}K, {warps} warps"] = (tri, "dst")
    # The device-only time of the per-tensor loop: the same copies replayed from a CUDA graph.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            loop()
    torch.cuda.synchronize()
    methods["copy_ per tensor, CUDA graph replay"] = (graph.replay, "dst")

    def check() -> bool:
        ok = True
        for d, s in zip(dsts, srcs, strict=True):
            ok &= bool(torch.equal(d.view(-1).view(torch.int16), s.reshape(-1).view(torch.int16)))
        return ok

    rows = []
    for name, (fn, kind) in methods.items():
        verified = "-"
        if kind == "dst":
            for d in dsts:
                d.view(torch.int16).fill_(-1)  # poison (a NaN pattern)
            fn()
            torch.cuda.synchronize()
            verified = "yes" if check() else "NO"
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        ev, host, issue = [], [], []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            fn()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            host.append(time.perf_counter() - t0)
            issue.append(t1 - t0)
            ev.append(a.elapsed_time(b) / 1e3)
        nb = payload if "contiguous" not in name else sum(x.numel() for x in buckets)
        rows.append((name, verified, median(ev), min(ev), median(host), median(issue), nb))
        print(f"# {name}: {median(ev) * 1e3:.3f} ms", flush=True)
    print(
        f"\n{len(entries)} tensors, {payload / 1e9:.3f} GB payload, {len(buckets)} buckets, "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    )
    print(f"{'method':44s}  ok  events ms   min ms  host ms  issue ms   GB/s")
    for name, ok, e, m, h, i, nb in rows:
        ms = f"{e * 1e3:9.3f} {m * 1e3:8.3f} {h * 1e3:8.3f} {i * 1e3:9.3f}"
        print(f"{name:44s} {ok:>3s} {ms} {nb / e / 1e9:6.0f}")


# --- trainer side and the table ---------------------------------------------------------------------------


def run_mode(
    args: argparse.Namespace, size_gb: float, mode: str, port: int, password: str, shm: Path
) -> dict:
    import dataclasses

    import torch

    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.wiring import new_writer

    env = env_for(args, port, password, mode, shm)
    reader = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "reader",
            "--mode",
            mode,
            "--device",
            args.device,
            "--size-gb",
            str(size_gb),
            "--tensors",
            str(args.tensors),
            "--steps",
            str(args.steps),
            "--heap-objects",
            str(args.heap_objects),
            "--reader-copy",
            args.reader_copy,
            *(["--serial-open"] if args.serial_open else []),
            *(["--ready-spin-ms", *map(str, args.ready_spin_ms)] if args.ready_spin_ms else []),
            *(["--trace"] if args.trace else []),
        ],
        env={
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    device = "cuda:0" if args.device == "cuda" else "cpu"
    cfg = ColocateConfig.from_env(env)
    writer = new_writer(cfg, device=0 if args.device == "cuda" else None)
    if mode == "per_tensor":  # a one-byte cap: every tensor gets its own bucket, i.e. its own IPC handle
        writer.settings = dataclasses.replace(writer.settings, bucket_bytes=1)
    weights = {
        f"layers.{i}.weight": torch.randn(s, device=device, dtype=torch.bfloat16)
        for i, s in enumerate(shapes(int(size_gb * 1e9), args.tensors))
    }
    layout = None
    if mode.startswith("in_place"):  # the weights as views of one buffer (Megatron's DDP layout), as they are
        flat = torch.cat([t.view(-1) for t in weights.values()])
        views, at = {}, 0
        for name, t in weights.items():
            views[name] = flat[at : at + t.numel()].view(t.shape)
            at += t.numel()
        weights = views
        layout = writer.in_place_layout([WholeTensor(n, t) for n, t in weights.items()], min_adopt_bytes=0)
    nbytes = sum(t.numel() * 2 for t in weights.values())
    trace = trace_writer(writer) if args.trace else None
    starts: list[float] = []
    writer_steps = []
    spins = args.ack_spin_ms or [writer.settings.ack_spin_s * 1e3]
    ready_spins = args.ready_spin_ms or [cfg.ready_spin_ms]
    try:
        for step in range(1, args.steps + 1):
            # Spin values alternate step by step: a paired comparison, immune to the machine's drift.
            spin_ms = spins[step % len(spins)]
            writer.settings = dataclasses.replace(writer.settings, ack_spin_s=spin_ms / 1e3)
            starts.append(time.perf_counter())  # the trainer's step is done
            if layout is not None:
                # in_place_kept: the reader keeps the buffer mapped across steps (colocated/kept.py)
                pending = writer.publish_in_place(step, layout, keep_mapped=mode == "in_place_kept")
            else:
                pending = writer.publish(step, weights)
            t0 = time.perf_counter()
            report = writer.wait_and_free(pending)
            writer_steps.append(
                {
                    **report.phase_seconds,
                    "end_to_end": report.phase_seconds["publish"] + report.phase_seconds["wait_ack"],
                    "after_publish": time.perf_counter() - t0,
                    "handles": report.handles,
                    "ack_spin_ms": spin_ms,
                    "ready_spin_ms": ready_spins[step % len(ready_spins)],
                }
            )
        stdout, _ = reader.communicate(timeout=600)
    finally:
        writer.close()
        if reader.poll() is None:
            reader.kill()
    result = json.loads(stdout.strip().splitlines()[-1])
    if trace is not None:
        print(f"# calls of a {size_gb:g} GB {mode} step, both processes on one clock (bench/call_trace.py):")
        print(timeline(starts, trace.spans + [tuple(s) for s in result["spans"]]), flush=True)
    return {"size_gb": size_gb, "mode": mode, "bytes": nbytes, "writer": writer_steps, **result}


def by_spin(result: dict) -> list[dict]:
    """One result per pair of spin values (--ack-spin-ms A B, --ready-spin-ms C D) holding that pair's steps
    (the table drops the first of each as its warm-up). Reader rows pair with writer rows by step."""
    pairs = sorted({(w["ack_spin_ms"], w["ready_spin_ms"]) for w in result["writer"]})
    if len(pairs) < 2:
        return [result]
    out = []
    for pair in pairs:
        picked = [i for i, w in enumerate(result["writer"]) if (w["ack_spin_ms"], w["ready_spin_ms"]) == pair]
        out.append(
            {
                **result,
                "mode": f"{result['mode']} ack spin {pair[0]:g} ready spin {pair[1]:g}",
                "writer": [result["writer"][i] for i in picked],
                "reader": [result["reader"][i] for i in picked],
            }
        )
    return out


class WholeTensor:
    """A trainer tensor published as it is (in_place mode): the piece is the whole tensor."""

    def __init__(self, name: str, tensor) -> None:  # type: ignore[no-untyped-def]
        from colocate_runtime.shards import Box, TensorShard

        shape = tuple(tensor.shape)
        self.shard = TensorShard(name, shape, "bfloat16", Box.full(shape))
        self.tensor = tensor

    def data(self):  # type: ignore[no-untyped-def]
        return self.tensor

    def view(self):  # type: ignore[no-untyped-def]
        return self.tensor


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(results: list[dict]) -> str:
    head = (
        "size",
        "mode",
        "handles",
        "pack",
        "publish",
        "fetch",
        "open",
        "copy",
        "close",
        "ack",
        "gc",
        "ack wait",
        "end-to-end",
        "TB/s",
        "d2d floor flat/loop",
    )
    rows = [head]
    for r in results:
        timed_w = r["writer"][1:] or r["writer"]  # the first step is a warm-up
        timed_r = r["reader"][1:] or r["reader"]
        e2e = median([w["end_to_end"] for w in timed_w])
        rows.append(
            (
                f"{r['bytes'] / 1e9:.3g} GB",
                r["mode"],
                str(timed_w[0]["handles"]),
                *(f"{median([w[k] for w in timed_w]) * 1e3:.2f}" for k in ("pack", "publish")),
                *(
                    f"{median([x['seconds'].get(k, 0.0) for x in timed_r]) * 1e3:.2f}"
                    for k in ("fetch", "open", "copy", "close", "ack")
                ),
                "yes" if any(x["gc"] for x in timed_r) else "no",
                f"{median([w['wait_ack'] for w in timed_w]) * 1e3:.2f}",
                f"{e2e * 1e3:.2f}",
                f"{r['bytes'] / e2e / 1e12:.2f}",
                "-"
                if not r.get("d2d_floor_s")
                else "{flat:.2f} / {loop:.2f}".format(**{k: v * 1e3 for k, v in r["d2d_floor_s"].items()}),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (
        "\n".join(lines)
        + "\n(ms, median of the timed steps; end-to-end = publish + the wait from the manifest's write to the"
        " ACK (the trainer's pack, a copy of every byte except in_place, is shown apart); open = time in"
        " the open calls, copy = the rest of open+copy until the device is done: they overlap; floor: best of"
        " five, flat = one copy of all the bytes, loop = copy_ per tensor)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("bench", "reader", "copy"), default="bench")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size-gb", type=float, nargs="+", default=[8.0])
    p.add_argument("--tensors", type=int, default=400, help="tensor count (an 8B model has about 400)")
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4, help="steps per mode; the first is a warm-up")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--mode", choices=MODES, default="grouped")
    p.add_argument("--heap-objects", type=int, default=1_000_000)
    p.add_argument(
        "--reader-copy",
        choices=("kernel", "loop"),
        default="kernel",
        help="the reader's copy: one batched kernel launch per bucket, or copy_ per entry (the earlier way)",
    )
    p.add_argument("--serial-open", action="store_true", help="open every bucket before copying any")
    p.add_argument(
        "--ack-spin-ms",
        type=float,
        nargs="+",
        help="the trainer's ACK spin (COLOCATE_ACK_SPIN_MS); several values alternate step by step and get a "
        "row each",
    )
    p.add_argument(
        "--ready-spin-ms",
        type=float,
        nargs="+",
        help="the reader's spin for the next step (COLOCATE_READY_SPIN_MS); several values alternate step by "
        "step (with --ack-spin-ms: use lists whose lengths pair every value with every other)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also time the runtime's calls in both processes and print where a step's time goes (slower)",
    )
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per method (--role copy)")
    p.add_argument("--json", default="", help="also write the raw results here")
    args = p.parse_args()
    if args.role == "reader":
        args.size_gb = args.size_gb[0]
        run_reader(args)
        return
    if args.role == "copy":
        copy_methods(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --device cpu for a smoke run")
        torch.cuda.set_device(0)
        print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="colocated-bench-"))
    server = start_redis(workdir)
    results = []
    try:
        for size in args.size_gb:
            for mode in args.modes:
                results += by_spin(run_mode(args, size, mode, server.port, server.password, workdir / "shm"))
                print(f"# done: {size} GB {mode}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    print(
        f"# heap objects in the inference process: {args.heap_objects}; bucket cap {args.bucket_mb} MiB; "
        f"reader copy: {args.reader_copy}, {'serial' if args.serial_open else 'overlapped'} open"
    )
    print("# reproduce: " + shlex.join([sys.executable, "bench/colocated_bench.py", *sys.argv[1:]]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
