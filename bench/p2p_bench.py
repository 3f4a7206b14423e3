"""Benchmark of the cross-GPU reshard executor against plain NCCL sends of the same bytes, on two ranks.

Scenarios (both on a synthetic decoder with Llama-style shapes; `llama8b` is 291 bf16 tensors, ~16 GB):
  move  every tensor from rank 0 to rank 1, by (a) the executor with its chunk budget, (b) one flat send of
        the same bytes (the ceiling), (c) tensor-by-tensor sends, (d) one batch_isend_irecv of all tensors;
  swap  an all-to-all reshard: tensor-parallel shards trade places, so both ranks send and receive at once;
        (a) the executor against (b) one flat send each way at the same time.

Prints plan time, chunk count, seconds (median), GB/s per direction, percent of the flat send, peak extra
memory (caching-allocator peak above what was allocated before; CUDA only) and the command that reproduces
the table. Runs on CPU with gloo for a smoke test: --device cpu --preset tiny.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


import runtime_path  # noqa: E402, F401  (maps colocate_runtime onto ./runtime when not installed)

from colocate_runtime.p2p.chunks import DIRECT_MIN_BYTES, plan_chunks, shard_shapes  # noqa: E402
from colocate_runtime.p2p.config import ExecutorBenchSwitches, ExecutorConfig  # noqa: E402
from colocate_runtime.p2p.executor import P2PExchange  # noqa: E402
from colocate_runtime.p2p.layout import Layout, ParamShards, split_box  # noqa: E402
from colocate_runtime.p2p.plan import build_plan  # noqa: E402
from colocate_runtime.shards import Box, stable_hash  # noqa: E402

PRESETS = {
    # hidden, intermediate, layers, vocab, heads, kv heads
    "llama8b": (4096, 14336, 32, 128256, 32, 8),
    "small": (2048, 5632, 8, 32000, 16, 4),
    "tiny": (64, 176, 2, 500, 4, 2),
}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # tensor-parallel dimension, None when replicated


def model_tensors(hidden: int, inter: int, layers: int, vocab: int, heads: int, kv: int) -> list[Tensor]:
    head = hidden // heads
    out = [Tensor("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            Tensor(p + "self_attn.q_proj.weight", (heads * head, hidden), 0),
            Tensor(p + "self_attn.k_proj.weight", (kv * head, hidden), 0),
            Tensor(p + "self_attn.v_proj.weight", (kv * head, hidden), 0),
            Tensor(p + "self_attn.o_proj.weight", (hidden, heads * head), 1),
            Tensor(p + "mlp.gate_proj.weight", (inter, hidden), 0),
            Tensor(p + "mlp.up_proj.weight", (inter, hidden), 0),
            Tensor(p + "mlp.down_proj.weight", (hidden, inter), 1),
            Tensor(p + "input_layernorm.weight", (hidden,), None),
            Tensor(p + "post_attention_layernorm.weight", (hidden,), None),
        ]
    out += [Tensor("model.norm.weight", (hidden,), None), Tensor("lm_head.weight", (vocab, hidden), 0)]
    return out


def layouts(scenario: str, tensors: list[Tensor]) -> tuple[Layout, Layout]:
    def whole_on(rank: int) -> Layout:
        return Layout.of(
            ParamShards(t.name, t.shape, "bfloat16", ((rank, Box.full(t.shape)),)) for t in tensors
        )

    def tp2(order: tuple[int, int]) -> Layout:
        params = []
        for t in tensors:
            if t.split_dim is None:
                shards = ((0, Box.full(t.shape)), (1, Box.full(t.shape)))
            else:
                shards = tuple(sorted((r, split_box(t.shape, t.split_dim, 2, order[r])) for r in (0, 1)))
            params.append(ParamShards(t.name, t.shape, "bfloat16", shards))
        return Layout.of(params)

    if scenario == "move":
        return whole_on(0), whole_on(1)
    return tp2((0, 1)), tp2((1, 0))


def fill(name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Deterministic values that differ per tensor, cheap to regenerate on the receiver for checking."""
    g = torch.Generator(device=device).manual_seed(int(stable_hash(name)[:8], 16))
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def shard_tensors(
    layout: Layout, rank: int, device: torch.device, *, filled: bool
) -> dict[str, torch.Tensor]:
    out = {}
    for s in layout.rank_shards(rank).shards:
        if filled:
            full = fill(s.name, s.global_shape, device)
            out[s.name] = full[s.box.slices()].clone()
            del full
        else:
            out[s.name] = torch.empty(s.box.lengths, dtype=torch.bfloat16, device=device)
    return out


def verify(layout: Layout, rank: int, targets: dict[str, torch.Tensor], device: torch.device) -> bool:
    expected = shard_tensors(layout, rank, device, filled=True)
    return all(torch.equal(targets[n], expected[n]) for n in expected)


class Timer:
    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[], object]) -> tuple[float, int]:
        """Median seconds over `iters` (slowest rank each time) and the peak extra allocated bytes."""
        times, peak = [], 0
        for i in range(self.warmup + self.iters):
            self.sync()
            dist.barrier()
            self.sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
            start = time.perf_counter()
            fn()
            self.sync()
            elapsed = time.perf_counter() - start
            extra = torch.cuda.max_memory_allocated(self.device) - base if self.device.type == "cuda" else 0
            votes = torch.tensor([elapsed, float(extra)], dtype=torch.float64, device=self.device)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
            if i >= self.warmup:
                times.append(float(votes[0]))
                peak = max(peak, int(votes[1]))
        return statistics.median(times), peak


def flat_exchange(nbytes: int, rank: int, device: torch.device, both_ways: bool) -> Callable[[], None]:
    buf = {"send": None, "recv": None}

    def run() -> None:
        # Buffers are allocated inside the timed call so their bytes show as the flat send's extra memory.
        ops = []
        if rank == 0 or both_ways:
            buf["send"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.isend, buf["send"], 1 - rank))
        if rank == 1 or both_ways:
            buf["recv"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buf["recv"], 1 - rank))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        buf["send"] = buf["recv"] = None

    return run


def per_tensor(sources: dict, targets: dict, rank: int, one_batch: bool) -> Callable[[], None]:
    names = sorted(sources) if rank == 0 else sorted(targets)

    def run() -> None:
        ops = [
            dist.P2POp(dist.isend, sources[n], 1) if rank == 0 else dist.P2POp(dist.irecv, targets[n], 0)
            for n in names
        ]
        if one_batch:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        else:
            for op in ops:
                for w in dist.batch_isend_irecv([op]):
                    w.wait()

    return run


def chunked_flat(nbytes: int, capacity: int, rank: int, device: torch.device) -> Callable[[], None]:
    """The flat send cut into capacity-sized ops: what chunk granularity alone costs, without any copies."""

    def run() -> None:
        buf = torch.empty(capacity, dtype=torch.uint8, device=device)
        works = []
        for start in range(0, nbytes, capacity):
            piece = buf[: min(capacity, nbytes - start)]
            op = dist.P2POp(dist.isend, piece, 1) if rank == 0 else dist.P2POp(dist.irecv, piece, 0)
            works += dist.batch_isend_irecv([op])
        for w in works:
            w.wait()

    return run


def copies_only(tensors: dict[str, torch.Tensor], capacity: int, device: torch.device) -> Callable[[], None]:
    """The bytes of `tensors` copied through a capacity-sized staging buffer: the executor's packing work."""

    def run() -> None:
        staging = torch.empty(capacity, dtype=torch.uint8, device=device)
        offset = 0
        for t in tensors.values():
            flat = t.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), capacity):
                piece = flat[start : start + capacity]
                if offset + piece.numel() > capacity:
                    offset = 0
                staging[offset : offset + piece.numel()].copy_(piece)
                offset += piece.numel()

    return run


def flat_while_copying(
    nbytes: int, tensors: dict[str, torch.Tensor], capacity: int, rank: int, device: torch.device
) -> Callable[[], None]:
    """The flat send with the packing copies running at the same time on another stream: contention."""
    send = flat_exchange(nbytes, rank, device, both_ways=False)
    copy = copies_only(tensors, capacity, device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run() -> None:
        if stream is None:
            send()
            copy()
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            copy()
        send()
        torch.cuda.current_stream(device).wait_stream(stream)

    return run


def worker(rank: int, args: argparse.Namespace, store_path: str, out: mp.Queue) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device = torch.device("cpu")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    shape = list(PRESETS[args.preset])
    for i, override in enumerate((args.hidden, args.intermediate, args.layers, args.vocab)):
        if override:
            shape[i] = override
    tensors = model_tensors(*shape)
    config = ExecutorConfig(
        budget_bytes=args.budget_mb << 20,
        pipeline_depth=args.depth,
        timeout_s=300.0,
        direct_min_bytes=int(args.direct_min_mb * (1 << 20)),
        bench=ExecutorBenchSwitches(one_batch_per_peer=not args.split_batches),
    )
    timer = Timer(device, args.warmup, args.iters)
    rows = []
    for scenario in args.scenarios:
        senders, receivers = layouts(scenario, tensors)
        start = time.perf_counter()
        plan = build_plan(senders, receivers)
        chunk_plan = plan_chunks(
            plan,
            config.budget_bytes,
            config.pipeline_depth,
            shard_shapes(senders, receivers),
            config.direct_min_bytes,
        )
        plan_s = time.perf_counter() - start
        per_dir = max(
            max(plan.sent_bytes().values(), default=0), max(plan.received_bytes().values(), default=0)
        )
        sources = shard_tensors(senders, rank, device, filled=True)
        targets = shard_tensors(receivers, rank, device, filled=False)
        exchange = P2PExchange.create(senders, receivers, device=device, config=config)
        report = exchange.run(sources, targets)
        ok = verify(receivers, rank, targets, device)
        votes = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        both = scenario == "swap"
        measured = {
            "flat send": timer.measure(flat_exchange(per_dir, rank, device, both)),
            "executor": timer.measure(partial(exchange.run, sources, targets)),
        }
        if scenario == "move":
            measured["tensor by tensor"] = timer.measure(per_tensor(sources, targets, rank, one_batch=False))
            measured["one batch, all tensors"] = timer.measure(
                per_tensor(sources, targets, rank, one_batch=True)
            )
        if scenario == "move" and args.diagnose:
            capacity = chunk_plan.capacity
            local = sources if rank == 0 else targets
            measured["diag: flat, chunk-sized ops"] = timer.measure(
                chunked_flat(per_dir, capacity, rank, device)
            )
            measured["diag: packing copies only"] = timer.measure(copies_only(local, capacity, device))
            measured["diag: flat while copying"] = timer.measure(
                flat_while_copying(per_dir, local, capacity, rank, device)
            )
        flat_s = measured["flat send"][0]
        for method, (seconds, extra) in measured.items():
            rows.append(
                {
                    "scenario": scenario,
                    "method": method,
                    "bytes": per_dir,
                    "plan_s": plan_s if method == "executor" else None,
                    "chunks": chunk_plan.n_chunks if method == "executor" else None,
                    "seconds": seconds,
                    "gbps": per_dir / seconds / 1e9,
                    "pct": 100.0 * flat_s / seconds,
                    "extra": extra,
                    "staging": report.staging_bytes if method == "executor" else None,
                    "verified": (int(votes[0]) == 0) if method == "executor" else None,
                }
            )
        del sources, targets, exchange
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        out.put(
            {"tensors": len(tensors), "model_bytes": sum(2 * _numel(t.shape) for t in tensors), "rows": rows}
        )
    dist.barrier()
    dist.destroy_process_group()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def print_table(args: argparse.Namespace, result: dict) -> None:
    print(
        f"p2p bench: preset {args.preset}, {result['tensors']} tensors, {_gb(result['model_bytes'])} bf16, "
        f"2 x {args.device}, budget {args.budget_mb} MiB, pipeline depth {args.depth}, "
        f"own message from {args.direct_min_mb:g} MiB, "
        f"{'one batch per message pair' if args.split_batches else 'one batch per peer'}, "
        f"median of {args.iters} after {args.warmup} warm-up"
    )
    header = (
        f"{'scenario':<8} {'method':<30} {'bytes/dir':>10} {'plan s':>8} {'chunks':>6} {'seconds':>9} "
        f"{'GB/s':>8} {'% flat':>7} {'peak extra':>11} {'staging':>10} {'bitwise':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        extra = _gb(r["extra"]) if args.device == "cuda" else "n/a"
        plan_s = "" if r["plan_s"] is None else f"{r['plan_s']:.3f}"
        chunks = "" if r["chunks"] is None else str(r["chunks"])
        staging = "" if r["staging"] is None else _gb(r["staging"])
        verified = "" if r["verified"] is None else ("ok" if r["verified"] else "WRONG")
        print(
            f"{r['scenario']:<8} {r['method']:<30} {_gb(r['bytes']):>10} {plan_s:>8} {chunks:>6} "
            f"{r['seconds']:>9.4f} {r['gbps']:>8.1f} {r['pct']:>6.1f}% {extra:>11} {staging:>10} "
            f"{verified:>7}"
        )
    print(f"reproduce: NCCL_NVLS_ENABLE=0 python {shlex.join(sys.argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    parser.add_argument("--hidden", type=int, default=0, help="override the preset's hidden size")
    parser.add_argument("--intermediate", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=0)
    parser.add_argument("--budget-mb", type=int, default=1024, help="executor staging budget (MiB)")
    parser.add_argument("--depth", type=int, default=2, help="chunks in flight")
    parser.add_argument(
        "--direct-min-mb",
        type=float,
        default=DIRECT_MIN_BYTES / (1 << 20),
        help="slices this big get their own message, unpacked",
    )
    parser.add_argument(
        "--split-batches", action="store_true", help="one batch per message pair instead of one per peer"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--scenarios", nargs="+", choices=["move", "swap"], default=["move", "swap"])
    parser.add_argument(
        "--diagnose", action="store_true", help="add rows that separate wire, copies, contention"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            sys.exit("needs 2 CUDA devices (or --device cpu --preset tiny)")
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast can take shared GPUs down
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, args, os.path.join(tmp, "store"), out)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        print_table(args, out.get(timeout=10))


if __name__ == "__main__":
    main()
