"""The weights check's own cost (runtime/colocated/digest.py) on one GPU, apart from a step: host time to
enqueue a step's sample, device time of its kernels, and the read-back, for a Qwen3-30B-A3B-sized rank
(18,867 entries, 61 GB, in one bucket as the in-place step publishes it). The whole step's cost, with and
without the check, is bench/step_bench.py's (`--digest both`). One JSON line per period goes to
bench/results/digest.jsonl.

    python bench/digest_bench.py                      # on an H200
    python bench/digest_bench.py --periods 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import runtime_path  # noqa: F401  (maps colocate_runtime onto ./runtime when not installed)

RESULTS = Path(__file__).resolve().parent / "results" / "digest.jsonl"


def entries(experts: int, layers: int, other: int):  # type: ignore[no-untyped-def]
    """Expert gate/up/down pieces (768 x 2048 bf16 each) and `other` attention/norm-sized entries."""
    from colocate_runtime.colocated.buckets import EntrySpec, plan_buckets

    specs = [
        EntrySpec(f"model.layers.{i}.mlp.experts.{e}.{w}.weight", "bfloat16", (768, 2048))
        for i in range(layers)
        for e in range(experts)
        for w in ("gate_proj", "up_proj", "down_proj")
    ]
    specs += [EntrySpec(f"other.{k}", "bfloat16", (512, 2048)) for k in range(other)]
    return plan_buckets(specs, 1 << 40)


def main() -> None:
    import torch

    from colocate_runtime.colocated import digest

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--periods", type=int, nargs="+", default=[1024])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    plan = entries(128, 48, 435)
    (spec,) = plan.buckets
    flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    flat[:: 1 << 20] = 7  # something to read; the kernel's cost does not depend on the values
    for period in args.periods:
        program = digest.trainer_program(plan.entries, [spec.index], period, device)
        host, gpu, back = [], [], []
        for step in range(args.repeat + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            sums = program.launch(step, lambda _: flat)
            end.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            program.finish(sums)
            t3 = time.perf_counter()
            if step:  # the first compiles
                host.append((t1 - t0) * 1e6)
                gpu.append(start.elapsed_time(end) * 1e3)
                back.append((t3 - t2) * 1e6)
        row = {
            "period": period,
            "entries": len(plan.entries),
            "gb": spec.nbytes / 1e9,
            "chunk_bytes": program.chunk,
            "chunks": program.nchunks,
            "tiles": program.ntiles,
            "sampled_mb": program.sampled_bytes / 1e6,
            "enqueue_us": statistics.median(host),
            "device_us": statistics.median(gpu),
            "read_back_us": statistics.median(back),
            "device": torch.cuda.get_device_name(0),
        }
        print(json.dumps(row), flush=True)
        if not args.no_save:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
