"""Cost of the Megatron-core -> canonical -> SGLang conversion in one weight sync, on one GPU.

A Qwen3-30B-A3B-shaped tensor set (48 layers, 128 experts, bf16, ~61 GB for the whole model) is allocated
in each trainer rank's Megatron layout (random values) and converted by `colocate_runtime.convert`:

  plan      trainer_plan: the rank's canonical boxes (metadata, once per job, CPU)
  convert   TrainerRankPlan.convert: views where the layout allows, copies where it forces them (a rank
            holding several query groups has its q/k/v rows interleaved), device-synchronised
  pack      convert + copy of every piece into reused contiguous buckets (what any transfer does anyway)
  d2d       the rank's bytes at the measured device-to-device copy rate: the floor of a step moving them

Inference side: an SGLang rank's target boxes written into its fused parameters (qkv_proj, gate_up_proj,
w13/w2) from canonical pieces, piece by piece.

GB/s counts the bytes of the pieces over the convert time; "copied" are the bytes the converter itself reads
and writes. The share columns put the conversion beside the transfer it precedes: colocated (CUDA IPC, a
device copy at the measured d2d rate) and cross-GPU (NCCL at 370 GB/s, the figure measured on these
machines in docs/design.md section 8).

    python3 bench/convert_bench.py                        # on a GPU machine
    python3 bench/convert_bench.py --device cpu --preset tiny   # smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


import runtime_path  # noqa: E402, F401  (maps colocate_runtime onto ./runtime when not installed)

from colocate_runtime.convert import (  # noqa: E402
    MegatronLayout,
    MegatronRank,
    ModelDims,
    PipelineLayout,
    SGLangLayout,
    TrainerRankPlan,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.dtypes import torch_dtype  # noqa: E402
from colocate_runtime.shards import Box  # noqa: E402

NCCL_GBPS = 370.0
BUCKET_BYTES = 4 << 30

PRESETS = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        dtype="bfloat16",
    ),
    "tiny": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=1000,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        dtype="bfloat16",
    ),
}


def trainer_layouts(spec: ModelDims) -> list[tuple[str, MegatronLayout, MegatronRank]]:
    n = spec.num_layers
    return [
        ("TP1 EP1 (whole model)", MegatronLayout(), MegatronRank()),
        ("TP2 EP8", MegatronLayout(tp=2, ep=8, etp=1), MegatronRank(tp_rank=1, ep_rank=3)),
        (
            "TP4 PP4 EP8",
            MegatronLayout(tp=4, ep=8, etp=1, pipeline=PipelineLayout.even(n, 4)),
            MegatronRank(tp_rank=2, pp_rank=1, ep_rank=5),
        ),
        (
            "TP2 PP2 VPP2 EP4 ETP2",
            MegatronLayout(tp=2, ep=4, etp=2, pipeline=PipelineLayout.even(n, 2, 2)),
            MegatronRank(tp_rank=1, pp_rank=0, ep_rank=1, etp_rank=1),
        ),
    ]


def inference_layouts() -> list[tuple[str, SGLangLayout, int]]:
    return [("SGLang TP4", SGLangLayout(tp=4), 1), ("SGLang TP8 EP8", SGLangLayout(tp=8, ep=8), 5)]


def median_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    fn()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def megatron_tensors(plan: TrainerRankPlan, device: torch.device) -> list[dict[str, torch.Tensor]]:
    dtype = torch_dtype(plan.spec.dtype)
    chunks = []
    for chunk in plan.chunks:
        tensors = {}
        for param in chunk.params:
            t = torch.empty(
                param.shape, dtype=torch.float32 if "expert_bias" in param.names[0] else dtype, device=device
            )
            tensors[param.names[0]] = t.normal_()  # never time on zeros
        chunks.append(tensors)
    return chunks


def pack(pieces: list[tuple], bucket: torch.Tensor) -> None:
    """Copy pieces into a reused flat bucket, as a transfer packs them (one bucket per dtype in practice)."""
    offset = 0
    for _, data in pieces:
        n = data.numel()
        if offset + n > bucket.numel():
            offset = 0
        bucket[offset : offset + n].view(data.shape).copy_(data)
        offset += n


def bench_trainer(spec: ModelDims, device: torch.device, repeat: int, d2d_rate: float) -> list[list[str]]:
    rows = []
    for label, layout, rank in trainer_layouts(spec):
        start = time.perf_counter()
        plan = trainer_plan(spec, layout, rank)
        plan_s = time.perf_counter() - start
        chunks = megatron_tensors(plan, device)
        sources = {t.untyped_storage().data_ptr() for chunk in chunks for t in chunk.values()}
        pieces = plan.convert(chunks)
        piece_bytes = sum(d.numel() * d.element_size() for _, d in pieces)
        copied = sum(
            d.numel() * d.element_size() for _, d in pieces if d.untyped_storage().data_ptr() not in sources
        )
        convert_s = median_seconds(lambda plan=plan, chunks=chunks: plan.convert(chunks), device, repeat)
        bucket = torch.empty(
            min(BUCKET_BYTES, piece_bytes) // 2, dtype=torch_dtype(spec.dtype), device=device
        )
        pack_s = median_seconds(
            lambda plan=plan, chunks=chunks, bucket=bucket: pack(plan.convert(chunks), bucket), device, repeat
        )
        d2d_s = piece_bytes / d2d_rate
        nccl_s = piece_bytes / (NCCL_GBPS * 1e9)
        rows.append(
            [
                label,
                str(len(pieces)),
                f"{piece_bytes / 1e9:.2f}",
                f"{2 * copied / 1e9:.2f}",
                f"{plan_s:.2f}",
                f"{convert_s * 1e3:.1f}",
                f"{piece_bytes / convert_s / 1e9:.0f}",
                f"{pack_s * 1e3:.1f}",
                f"{d2d_s * 1e3:.1f}",
                f"{convert_s / (convert_s + d2d_s):.0%}",
                f"{convert_s / (convert_s + nccl_s):.0%}",
            ]
        )
        del chunks, pieces, bucket
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def copy_rate(device: torch.device, repeat: int, nbytes: int) -> float:
    """Bytes per second of one large device-to-device copy (payload bytes, as docs/design.md counts them)."""
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    twin = torch.empty_like(flat)
    return nbytes / median_seconds(lambda: twin.copy_(flat), device, repeat)


def bench_inference(spec: ModelDims, device: torch.device, repeat: int) -> list[list[str]]:
    rows = []
    dtype = torch_dtype(spec.dtype)
    for label, layout, tp_rank in inference_layouts():
        start = time.perf_counter()
        plan = inference_plan(spec, layout, tp_rank)
        plan_s = time.perf_counter() - start
        params = {
            name: torch.empty(shape, dtype=dtype, device=device)
            for name, shape in plan.param_shapes().items()
        }
        received = [
            (s, torch.empty(s.box.lengths, dtype=torch_dtype(s.dtype), device=device).normal_())
            for s in plan.shards()
        ]
        nbytes = sum(d.numel() * d.element_size() for _, d in received)

        def write_each(plan=plan, params=params, received=received) -> None:
            for shard, data in received:
                plan.write(params, shard, data)

        each_s = median_seconds(write_each, device, repeat)
        many_s = median_seconds(
            lambda plan=plan, params=params, received=received: plan.write_many(params, received),
            device,
            repeat,
        )
        rows.append(
            [
                label,
                str(len(received)),
                f"{nbytes / 1e9:.2f}",
                f"{plan_s:.2f}",
                f"{each_s * 1e3:.1f}",
                f"{nbytes / each_s / 1e9:.0f}",
                f"{many_s * 1e3:.1f}",
                f"{nbytes / many_s / 1e9:.0f}",
            ]
        )
        del params, received
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def profile(spec: ModelDims, device: torch.device) -> None:
    """Where the per-piece time goes (host side): one whole-model convert, one SGLang TP4 write_many."""
    plan = trainer_plan(spec, MegatronLayout(), MegatronRank())
    chunks = megatron_tensors(plan, device)
    plan.convert(chunks)
    cProfile.runctx("plan.convert(chunks)", globals(), {"plan": plan, "chunks": chunks}, "/tmp/convert.prof")
    pstats.Stats("/tmp/convert.prof").sort_stats("tottime").print_stats(8)
    del chunks
    target = inference_plan(spec, SGLangLayout(tp=4), 1)
    dtype = torch_dtype(spec.dtype)
    params = {
        name: torch.empty(shape, dtype=dtype, device=device) for name, shape in target.param_shapes().items()
    }
    received = [(s, torch.empty(s.box.lengths, dtype=dtype, device=device)) for s in target.shards()]
    target.write_many(params, received)
    cProfile.runctx("target.write_many(params, received)", globals(), locals(), "/tmp/write.prof")
    pstats.Stats("/tmp/write.prof").sort_stats("tottime").print_stats(8)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile one whole-model convert and write_many"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = model_spec(PRESETS[args.preset])
    assert Box.full((1,)).numel == 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.preset} on {name}, torch {torch.__version__}, median of {args.repeat}")
    d2d_rate = copy_rate(device, args.repeat, 4 << 30 if device.type == "cuda" else 64 << 20)
    print(f"device-to-device copy: {d2d_rate / 1e9:.0f} GB/s of payload")
    trainer = bench_trainer(spec, device, args.repeat, d2d_rate)
    inference = bench_inference(spec, device, args.repeat)
    print()
    print(
        table(
            [
                "trainer rank",
                "pieces",
                "GB",
                "copied GB",
                "plan s",
                "convert ms",
                "GB/s",
                "pack ms",
                "d2d ms",
                "share IPC",
                "share NCCL",
            ],
            trainer,
        )
    )
    print()
    print(
        table(
            ["inference rank", "pieces", "GB", "plan s", "write ms", "GB/s", "write_many ms", "GB/s"],
            inference,
        )
    )
    print()
    if args.profile:
        profile(spec, device)
    print("reproduce: python3 " + " ".join(shlex.quote(a) for a in sys.argv))


if __name__ == "__main__":
    main()
