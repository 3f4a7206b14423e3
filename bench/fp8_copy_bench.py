"""The quantize-on-copy kernel alone (runtime/colocated/fp8_kernel.py) on one layer of Qwen3-30B-A3B's experts
(w13 + w2 of 128 experts, SGLang's shapes: 1.2 GB of BF16 in), per kernel variant, beside a BF16 `copy_` of
the same source. Each variant is checked bit for bit against the reference quantizer before it is timed.
Figures: milliseconds per launch (median of repeats), GB/s moved (BF16 read + e4m3 and scales written).
One JSON line per variant goes to bench/results/fp8_copy.jsonl.

    python bench/fp8_copy_bench.py                   # on an H200 (bash bench/colocated_device.sh fp8-copy)
    python bench/fp8_copy_bench.py --warps 4 8 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
from pathlib import Path

import runtime_path  # noqa: F401  (maps colocate_runtime onto ./runtime when not installed)
import torch

from colocate_runtime.colocated import fp8_block, fp8_copy
from colocate_runtime.colocated.fp8_block import BlockFp8

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "fp8_copy.jsonl"
SHAPES = [(128, 1536, 2048), (128, 2048, 768)]  # w13_weight, w2_weight of one A3B layer


def setup(fmt: BlockFp8):  # type: ignore[no-untyped-def]
    n = [torch.Size(s).numel() for s in SHAPES]
    g = torch.Generator(device="cuda").manual_seed(7)
    bucket = (torch.randn(sum(n), generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    blocks, outs, off = [], [], 0
    for shape, count in zip(SHAPES, n, strict=True):
        w = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(fmt.scale_shape(shape), device="cuda")
        strides = torch.empty(shape, device="meta").stride()
        blocks += fp8_copy.param_blocks(off, strides, w, s)
        outs.append((w, s, bucket[off : off + count].view(shape)))
        off += count
    return bucket, fp8_copy.build(blocks, torch.device("cuda"), fmt), outs


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--native", choices=("both", "yes", "no"), default="both")
    p.add_argument("--ue8m0", action="store_true", help="power-of-two scales")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    fmt = BlockFp8(ue8m0=args.ue8m0)
    natives = {"both": [False, True], "yes": [True], "no": [False]}[args.native]
    bucket, table, outs = setup(fmt)
    copy_dst = torch.empty_like(bucket)
    copy_ms = timed(lambda: copy_dst.copy_(bucket), args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    print(f"bf16 copy_ of {bucket.numel() * 2 / 1e9:.2f} GB: {copy_ms:.3f} ms")
    for warps, native in itertools.product(args.warps, natives):
        fp8_copy.WARPS, fp8_copy.NATIVE_CAST = warps, native
        for w, _, _ in outs:
            w.view(torch.uint8).fill_(0x55)
        table.launch(bucket)
        exact = all(
            torch.equal(w.view(torch.uint8), rq.view(torch.uint8))
            and torch.equal(s.view(torch.int32), rs.view(torch.int32))
            for w, s, src in outs
            for rq, rs in [fp8_block.quantize(src, fmt)]
        )
        ms = timed(lambda: table.launch(bucket), args.repeats)
        row = {
            "warps": warps,
            "native_cast": native,
            "ue8m0": fmt.ue8m0,
            "blocks": table.nblocks,
            "ms": ms,
            "gbps_moved": (table.src_bytes + table.dst_bytes) / ms / 1e6,
            "bf16_copy_ms": copy_ms,
            "ratio_to_bf16_copy": ms / copy_ms,
            "bitwise": exact,
            "device": torch.cuda.get_device_name(0),
            "commit": commit.stdout.strip(),
        }
        print(json.dumps(row), flush=True)
        if not args.no_save:
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
