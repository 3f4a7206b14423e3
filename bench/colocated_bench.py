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
import secrets
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("grouped", "per_tensor", "blanket_gc")
HIDDEN = 4096


def shapes(size_bytes: int, tensors: int) -> list[tuple[int, int]]:
    rows = max(1, size_bytes // (tensors * HIDDEN * 2))
    return [(rows, HIDDEN)] * tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int, str]:
    binary = os.environ.get("COLOCATE_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: install it or set COLOCATE_REDIS_SERVER")
    port, password = free_port(), secrets.token_hex(16)
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port, password=password)
    for _ in range(200):
        try:
            client.ping()
            return proc, port, password
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


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
    }


# --- inference side ---------------------------------------------------------------------------------------


def copy_floor(targets: dict) -> dict[str, float]:
    """Device-to-device copy of the same bytes from one distinct flat buffer into the targets (no IPC), by
    per-tensor copy_ and by one _foreach_copy_: the floor for the copy phase. Best of four."""
    import torch

    total = sum(t.numel() for t in targets.values())
    flat = torch.empty(total, dtype=torch.bfloat16, device="cuda:0")
    views, offset = [], 0
    for t in targets.values():
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    dsts = list(targets.values())
    result = {}
    for name in ("loop", "foreach"):
        best = float("inf")
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "loop":
                for d, v in zip(dsts, views, strict=True):
                    d.copy_(v)
            else:
                torch._foreach_copy_(dsts, views)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        result[name] = best
    del views, flat
    torch.cuda.empty_cache()
    return result


def run_reader(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    from colocate_runtime.colocated.config import ColocateConfig
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
    reader.settings = dataclasses.replace(
        reader.settings, blanket_gc=args.mode == "blanket_gc", verify_checksums=False
    )
    floor = None
    if args.device == "cuda":
        floor = copy_floor(targets)
    out = []
    for _ in range(args.steps):
        report = reader.apply_next(timeout_s=300)
        out.append({"step": report.step, "seconds": report.phase_seconds, "gc": report.gc_fallback})
    reader.close()
    print(json.dumps({"reader": out, "d2d_floor_s": floor, "heap": len(heap)}), flush=True)


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
    nbytes = sum(t.numel() * 2 for t in weights.values())
    writer_steps = []
    try:
        for step in range(1, args.steps + 1):
            pending = writer.publish(step, weights)
            t0 = time.perf_counter()
            report = writer.wait_and_free(pending)
            writer_steps.append(
                {
                    **report.phase_seconds,
                    "end_to_end": report.phase_seconds["publish"] + report.phase_seconds["wait_ack"],
                    "after_publish": time.perf_counter() - t0,
                    "handles": report.handles,
                }
            )
        stdout, _ = reader.communicate(timeout=600)
    finally:
        writer.close()
        if reader.poll() is None:
            reader.kill()
    result = json.loads(stdout.strip().splitlines()[-1])
    return {"size_gb": size_gb, "mode": mode, "bytes": nbytes, "writer": writer_steps, **result}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(results: list[dict]) -> str:
    head = (
        "size",
        "mode",
        "handles",
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
        "d2d floor loop/foreach",
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
                *(f"{median([w[k] for w in timed_w]) * 1e3:.2f}" for k in ("publish",)),
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
                else "{loop:.2f} / {foreach:.2f}".format(**{k: v * 1e3 for k, v in r["d2d_floor_s"].items()}),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (
        "\n".join(lines)
        + "\n(ms, median of the timed steps; end-to-end = publish + wait for ACK; copy ends with a sync)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("bench", "reader"), default="bench")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size-gb", type=float, nargs="+", default=[8.0])
    p.add_argument("--tensors", type=int, default=400, help="tensor count (an 8B model has about 400)")
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4, help="steps per mode; the first is a warm-up")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--mode", choices=MODES, default="grouped")
    p.add_argument("--heap-objects", type=int, default=1_000_000)
    p.add_argument("--json", default="", help="also write the raw results here")
    args = p.parse_args()
    if args.role == "reader":
        args.size_gb = args.size_gb[0]
        run_reader(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --device cpu for a smoke run")
        torch.cuda.set_device(0)
        print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="colocated-bench-"))
    redis_proc, port, password = start_redis(workdir)
    results = []
    try:
        for size in args.size_gb:
            for mode in args.modes:
                results.append(run_mode(args, size, mode, port, password, workdir / "shm"))
                print(f"# done: {size} GB {mode}", flush=True)
    finally:
        redis_proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    print(f"# heap objects in the inference process: {args.heap_objects}; bucket cap {args.bucket_mb} MiB")
    print("# reproduce: " + shlex.join([sys.executable, "bench/colocated_bench.py", *sys.argv[1:]]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
