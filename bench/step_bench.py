"""A whole colocated weight-sync step on one GPU, trainer process to SGLang process, through a real Redis.

Timed from "the trainer's step is done" to "SGLang's parameters are written, the verified close is done and
the trainer holds the ACK" (`publish` + `wait_and_free`), beside one flat device copy of the same bytes (the
floor). The trainer holds a Megatron-core rank in its own layout; the SGLang side holds its fused layout
(`qkv_proj`, `gate_up_proj`, stacked experts `w13_weight`/`w2_weight`, padded vocabulary), every parameter
allocated separately as SGLang does.

Modes (trainer side):
  inplace    parameters as views of one contiguous buffer (Megatron-core DDP's `param_data`); the one-pass
             update: the buffer's storage is published, the reader gathers straight into the fused
             parameters (runtime/colocated/inplace.py, gather.py)
  kept       inplace, and the reader keeps the buffer mapped from step to step (`keep_mapped`,
             runtime/colocated/kept.py): no open and no unmapping per step
  separate   one allocation per parameter (no DDP buffer): nothing large enough to export, so pieces are
             converted and packed into buckets, then copied (the fallback)
  packed     the DDP buffer, converted and packed every step (the path before the one-pass update)

`--via publisher` drives the inplace and kept modes through the trainer-side facade users call,
`colocate_runtime.megatron.Publisher.update` (engine=False: the reader here is not an SGLang server), so the
figure includes the facade's own work (the move check, the outcome agreement); `--via writer` calls the
writer directly.

Every run checks the installed bytes against the reference conversion (`TrainerRankPlan.convert`), bit for
bit, over every canonical piece (random bit patterns, NaN payloads included). Figures are medians of the
timed steps (after one warm-up); one JSON line per preset and mode goes to bench/results/step.jsonl.

    python bench/step_bench.py --preset qwen3-30b-a3b qwen3-30b-a3b-tp2ep8 qwen3-8b   # on an H200
    python bench/step_bench.py --via publisher --modes kept --preset qwen3-30b-a3b    # through the facade
    python bench/step_bench.py --device cpu --preset tiny                             # smoke test
    python bench/step_bench.py --target-dtype bfloat16 fp8_e4m3_block128 --modes kept --preset qwen3-30b-a3b
                                 # SGLang serving block FP8: quantized on the copy, beside the BF16 step
    python bench/step_bench.py --digest both --modes kept --preset qwen3-8b --steps 11
                                 # the weights check in every other step: its cost, as % of the step
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import runtime_path  # noqa: F401  (maps colocate_runtime onto ./runtime when not installed)
from colocated_bench import env_for, start_redis
from convert_bench import PRESETS as CONVERT_PRESETS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "step.jsonl"
SCALE_SUFFIX = "_scale_inv"  # reader digests of a block-FP8 piece's scale view
TARGET_DTYPES = ("bfloat16", "fp8_e4m3_block128")  # what SGLang holds: the model dtype, or block FP8
MODES = ("inplace", "kept", "separate", "packed")

QWEN3_30B_A3B = CONVERT_PRESETS["qwen3-30b-a3b"]
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    intermediate_size=12288,
    dtype="bfloat16",
)
TINY = dict(QWEN3_30B_A3B, hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=1000, num_experts=8)
TINY.update(intermediate_size=128, moe_intermediate_size=32, num_attention_heads=8)
# Small, with every fused part a whole 128-row block (what SGLang's block FP8 needs): the FP8 smoke test
TINY_BLOCKS = dict(TINY, hidden_size=256, head_dim=32, num_key_value_heads=4, moe_intermediate_size=128)


@dataclass(frozen=True)
class Preset:
    """A trainer rank and the SGLang rank on the same GPU: (megatron layout kwargs, rank kwargs), (sglang
    layout kwargs, tp rank). The reader's targets are the parts of its parameters this trainer rank holds;
    the rest of a resharded step crosses GPUs (the exchange), which one GPU cannot show."""

    model: dict
    megatron: dict
    rank: dict
    sglang: dict
    sglang_rank: int


PRESETS = {
    "qwen3-30b-a3b": Preset(QWEN3_30B_A3B, {}, {}, {"tp": 1}, 0),
    # A TP2-EP8 trainer rank (attention TP rank 0, experts 48..63) under SGLang TP2 EP2 rank 0 (experts 0-63).
    "qwen3-30b-a3b-tp2ep8": Preset(
        QWEN3_30B_A3B, {"tp": 2, "ep": 8, "etp": 1}, {"ep_rank": 3}, {"tp": 2, "ep": 2}, 0
    ),
    "qwen3-8b": Preset(QWEN3_8B, {}, {}, {"tp": 1}, 0),
    "tiny": Preset(TINY, {"tp": 2, "ep": 2, "etp": 1}, {}, {"tp": 2, "ep": 2}, 0),
    "tiny-blocks": Preset(TINY_BLOCKS, {"ep": 2, "etp": 1}, {"ep_rank": 1}, {"tp": 1}, 0),
}


def plans(preset: Preset):  # type: ignore[no-untyped-def]
    from colocate_runtime.convert import (
        MegatronLayout,
        MegatronRank,
        SGLangLayout,
        inference_plan,
        model_spec,
        trainer_plan,
    )

    spec = model_spec(preset.model)
    tplan = trainer_plan(spec, MegatronLayout(**preset.megatron), MegatronRank(**preset.rank))
    iplan = inference_plan(spec, SGLangLayout(**preset.sglang), preset.sglang_rank)
    return tplan, iplan


def local_boxes(tplan, iplan) -> dict:  # type: ignore[no-untyped-def]
    """Canonical name -> the box both the trainer rank and the SGLang rank on this GPU hold."""
    held = {s.name: s.box for s in tplan.shards()}
    out = {}
    for shard in iplan.shards():
        common = shard.box.intersect(held[shard.name]) if shard.name in held else None
        if common is not None:
            out[shard.name] = common
    return out


def digest(t):  # type: ignore[no-untyped-def]
    """Position-weighted sums of a tensor's raw 16-bit words: equal bits, equal digests (any device)."""
    import torch

    flat = t.contiguous().view(-1)
    words = flat.view(torch.uint8).to(torch.int16) if flat.element_size() == 1 else flat.view(torch.int16)
    plain = weighted = 0
    for start in range(0, words.numel(), 1 << 26):
        w = words[start : start + (1 << 26)].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        plain += int(w.sum())
        weighted += int((w * pos).sum())
    return [int(words.numel()), plain, weighted]


# --- SGLang side --------------------------------------------------------------------------------------------


def run_reader(args: argparse.Namespace) -> None:
    import torch

    from colocate_runtime.colocated import fp8_copy
    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.wiring import new_reader
    from colocate_runtime.shards import TensorShard

    fp8_copy.NATIVE_CAST = args.fp8_cast == "native"
    fp8_copy.WARPS = args.fp8_warps or fp8_copy.WARPS
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    tplan, iplan = plans(PRESETS[args.preset[0]])
    local = local_boxes(tplan, iplan)  # each target cut to what this GPU's trainer rank holds
    targets, scales, fmt = engine_targets(iplan, local, args.target_dtype[0], device)
    shards = {
        s.name: TensorShard(s.name, s.global_shape, s.dtype, local[s.name])
        for s in iplan.shards()
        if s.name in local
    }
    extra = {"scales": scales, "fp8_format": fmt} if scales else {}
    reader = new_reader(
        ColocateConfig.from_env(os.environ), targets, target_shards=shards, device=device, **extra
    )
    steps = []
    for _ in range(args.steps):
        report = reader.apply_next(timeout_s=600)
        steps.append(report.phase_seconds)
    digests = {name: digest(t) for name, t in targets.items()}
    digests.update({name + SCALE_SUFFIX: digest(t) for name, t in scales.items()})
    reader.close()
    print(json.dumps({"reader": steps, "digests": digests}), flush=True)


def engine_targets(iplan, local: dict, target_dtype: str, device):  # type: ignore[no-untyped-def]
    """SGLang's parameters, one allocation each, and the reader's views of them: (targets, scale views of the
    block-FP8 ones, their format). `target_dtype` "bfloat16": the model dtype throughout, no scales."""
    import torch

    from colocate_runtime.colocated.fp8_block import BlockFp8
    from colocate_runtime.convert.fp8 import Fp8Quantization, fp8_layout, read_fp8
    from colocate_runtime.dtypes import torch_dtype

    if target_dtype == "bfloat16":
        dtype = torch_dtype(iplan.spec.dtype)
        params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in iplan.param_shapes().items()}
        return (
            {
                s.name: v[local[s.name].relative_to(s.box).slices()]
                for s, v in iplan.read(params)
                if s.name in local
            },
            {},
            None,
        )
    quant = Fp8Quantization()
    params = {
        h.name: torch.zeros(h.shape, dtype=torch_dtype(h.dtype), device=device)
        for h in fp8_layout(iplan, quant).values()
    }
    targets, scales = read_fp8(iplan, params, quant, boxes=local)
    return targets, scales, BlockFp8(quant.block, quant.ue8m0)


def quantized_names(iplan) -> set[str]:  # type: ignore[no-untyped-def]
    """The canonical pieces an engine serving block FP8 holds in e4m3."""
    from colocate_runtime.convert.fp8 import Fp8Quantization, is_quantized

    quant = Fp8Quantization()
    return {
        p.shard.name for param in iplan.params if is_quantized(param.name, quant) for p in param.placements
    }


# --- trainer side -------------------------------------------------------------------------------------------


def megatron_rank(tplan, mode: str, device):  # type: ignore[no-untyped-def]
    """The rank's parameters, random bit patterns: views of one buffer, or one allocation each."""
    import math

    import torch

    from colocate_runtime.dtypes import torch_dtype

    params = [p for chunk in tplan.chunks for p in chunk.params if not p.optional]
    dtype = torch_dtype(tplan.spec.dtype)
    total = sum(math.prod(p.shape) for p in params)
    if mode == "separate":
        tensors = {p.names[0]: torch.empty(p.shape, dtype=dtype, device=device) for p in params}
        for t in tensors.values():
            t.view(torch.int16).random_()
        return None, tensors, total
    buffer = torch.empty(total, dtype=dtype, device=device)
    buffer.view(torch.int16).random_()
    tensors, at = {}, 0
    for p in params:
        n = math.prod(p.shape)
        tensors[p.names[0]] = buffer[at : at + n].view(p.shape)
        at += n
    return buffer, tensors, total


class TensorChunk:
    """What the Publisher reads from a model chunk, for a rank made of bare tensors: its state dict (the
    tensors themselves), its parameters and Megatron's padded vocabulary size."""

    def __init__(self, tensors: dict, vocab_size: int) -> None:
        self.tensors = tensors
        self.vocab_size = vocab_size

    def state_dict(self, keep_vars: bool = False) -> dict:
        return dict(self.tensors)

    def parameters(self):  # type: ignore[no-untyped-def]
        return iter(self.tensors.values())


def new_publisher(preset: Preset, tplan, tensors: dict, env: dict, mode: str):  # type: ignore[no-untyped-def]
    """The facade over this bare rank: a one-rank gloo world, the rank's coordinates given (no megatron-core
    here), no engine (the reader process stands in for SGLang's worker)."""
    import torch.distributed as dist

    from colocate_runtime.convert import MegatronRank
    from colocate_runtime.megatron import Publisher
    from colocate_runtime.megatron.parallel import ParallelState

    if not dist.is_initialized():
        with socket.socket() as probe:  # a free port for the one-rank world's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    lay, rank = tplan.layout, tplan.rank
    state = ParallelState(
        tp=lay.tp,
        tp_rank=rank.tp_rank,
        pp=1,
        pp_rank=0,
        ep=lay.ep,
        ep_rank=rank.ep_rank,
        etp=lay.expert_tp,
        etp_rank=rank.etp_rank,
        vpp=1,
        num_layers=tplan.spec.num_layers,
    )
    rows = lay.groups(tplan.spec, MegatronRank()).embedding_rows
    return Publisher(
        TensorChunk(tensors, rows),
        hf_config=preset.model,
        environ=env,
        keep_mapped=mode == "kept",
        engine=False,
        parallel_state=state,
    )


def _record_published(writer) -> dict[int, list]:  # type: ignore[no-untyped-def]
    """The buckets each step published, as the writer waits for its ACK (the wait frees them), whether the
    bench or the Publisher waits: for the kept-export counts."""
    published: dict[int, list] = {}
    wait = writer.wait_and_free

    def recording(pending, *args, **kwargs):  # type: ignore[no-untyped-def]
        published[pending.step] = list(pending.buckets)
        return wait(pending, *args, **kwargs)

    writer.wait_and_free = recording
    return published


def flat_copy_seconds(nbytes: int, device, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    """The floor: one device copy of `nbytes` between two flat buffers, best of `repeat`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return best


def sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(
    args: argparse.Namespace, name: str, mode: str, target: str, port: int, password: str, shm: Path
) -> dict:
    import torch

    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.wiring import new_writer

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tplan, _ = plans(PRESETS[name])
    nbytes = sum(s.box.numel for s in tplan.shards()) * 2
    floor_s = flat_copy_seconds(nbytes, device)  # before either side holds the model: memory for the twin
    env = {**env_for(args, port, password, mode, shm), "COLOCATE_STEP_TIMEOUT_SECONDS": "600"}
    env["COLOCATE_WEIGHT_DIGEST_PERIOD"] = str(args.digest_period)
    _, tensors, _ = megatron_rank(tplan, mode, device)
    reader = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "reader",
            "--preset",
            name,
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--target-dtype",
            target,
            "--fp8-cast",
            args.fp8_cast,
            *(["--fp8-warps", str(args.fp8_warps)] if args.fp8_warps else []),
        ],
        env={
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    publisher = None
    if args.via == "publisher" and mode in ("inplace", "kept"):
        publisher = new_publisher(PRESETS[name], tplan, tensors, env, mode)
        writer = publisher.writer
    else:
        writer = new_writer(ColocateConfig.from_env(env), device=device if device.type == "cuda" else None)
    steps = []
    shares: list[tuple[object, ...]] = []  # per step: which export of each kept bucket it published
    published_by_step = _record_published(writer)
    try:
        t0 = time.perf_counter()
        pieces = tplan.bind(tensors)
        adopt = args.min_adopt_mb << 20
        layout = writer.in_place_layout(pieces, min_adopt_bytes=adopt) if mode != "packed" else None
        if publisher is not None:
            layout = publisher.layout  # compiled by the Publisher from the same tensors
        compile_s = time.perf_counter() - t0
        for step in range(1, args.steps + 1):
            check = digest_runs(args.digest, step)  # the weights check, on or off for this step
            writer.settings = dataclasses.replace(writer.settings, digest_period=args.digest_period * check)
            next(iter(tensors.values())).view(torch.int16)[::4096].add_(step)  # the training step's writes
            sync(device)
            t0 = time.perf_counter()
            if publisher is not None:
                t_convert = t0
                report = publisher.update(step)
                pending = publisher.last_pending
            elif layout is None:
                converted = tplan.convert(tensors)
                t_convert = time.perf_counter()
                pending = writer.publish(
                    step, {s.name: d for s, d in converted}, shards={s.name: s for s, _ in converted}
                )
            else:
                t_convert = t0
                pending = writer.publish_in_place(step, layout, keep_mapped=mode == "kept")
            if publisher is None:
                report = writer.wait_and_free(pending)
            published = published_by_step[step]  # waiting freed the step's buckets
            total = time.perf_counter() - t0
            steps.append({"convert": t_convert - t0, **report.phase_seconds, "total": total, "digest": check})
            ack = writer.store.read_ack(writer.gen, step, writer.uuid)  # outside the timed step
            kept = 0 if ack is None else len(ack.kept)
            opened_kept = 0 if ack is None else len(set(ack.kept) & set(ack.opened or ()))
            shares.append(tuple(_share(b.descriptor) for b in published if ack and b.index in ack.kept))
        stdout, _ = reader.communicate(timeout=1200)
        # The last step's exports of kept buckets: one read through the reader's anchor stays exported with
        # its share (1) for the next step, and the writer's close gives that share back.
        last_kept = [b.descriptor for b in published if ack is not None and b.index in ack.kept]
        shares_before = [_count(d) for d in last_kept]
    finally:
        (publisher or writer).close()
        if reader.poll() is None:
            reader.kill()
    shares_after = [_count(d) for d in last_kept]
    if reader.returncode != 0:
        sys.exit(f"the reader process failed (exit {reader.returncode})")
    result = json.loads(stdout.strip().splitlines()[-1])
    # The reference: the converter's own output, cut to what SGLang holds here.
    local = local_boxes(tplan, plans(PRESETS[name])[1])
    want = reference_digests(
        pieces, local, quantized_names(plans(PRESETS[name])[1]) if target != "bfloat16" else ()
    )
    wrong = sorted(n for n, d in result["digests"].items() if want.get(n) != d)
    missing = sorted(set(want) - set(result["digests"]))
    timed = steps[1:] or steps
    reader_timed = result["reader"][1:] or result["reader"]
    unchecked = [r for r in timed if not r["digest"]]  # --digest both: the steps without the check
    if args.digest == "both":
        timed = [r for r in timed if r["digest"]]
        reader_timed = [r for r in reader_timed if "digest" in r]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows) * 1e3

    adopted = 0 if layout is None else len(layout.adopted)
    packed = nbytes if layout is None else layout.packed_bytes
    return {
        "preset": name,
        "mode": mode,
        "target_dtype": target,
        "fp8_native_cast": args.fp8_cast == "native" if target != "bfloat16" else None,
        "fp8_warps": (args.fp8_warps or None) if target != "bfloat16" else None,
        "via": "publisher" if publisher is not None else "writer",
        "ms": med(timed, "total"),
        "floor_ms": floor_s * 1e3,
        "gb": nbytes / 1e9,
        "phases_ms": {
            "convert": med(timed, "convert"),
            "pack": med(timed, "pack"),
            "publish": med(timed, "publish"),
            "fetch": med(reader_timed, "fetch"),
            "open": med(reader_timed, "open"),
            "copy": med(reader_timed, "copy"),
            "close": med(reader_timed, "close"),
            "verify": med(reader_timed, "verify"),
            "digest": med(reader_timed, "digest"),
            "ack": med(reader_timed, "ack"),
            "wait_ack": med(timed, "wait_ack"),
            "free": med(timed, "free"),
        },
        "compile_s": compile_s,
        # The weights check (runtime/colocated/digest.py) ran in the steps of "ms"; with --digest both, the
        # steps in between ran without it: its cost is the difference of the medians.
        "digest": args.digest != "off",
        "digest_period": args.digest_period,
        **(
            {
                "digest_off_ms": med(unchecked, "total"),
                "digest_cost_ms": med(timed, "total") - med(unchecked, "total"),
                "digest_cost_pct": 100 * (med(timed, "total") / med(unchecked, "total") - 1),
            }
            if args.digest == "both" and unchecked
            else {}
        ),
        "handles": adopted,
        "kept": kept,  # buckets the reader still maps after the last step (kept mode)
        # kept mode: steps that published the previous step's exports again (kept.py: read through the
        # reader's anchor, nothing opened), and kept buckets the last step's reader opened itself
        "republished": sum(1 for a, b in itertools.pairwise(shares) if a and a == b),
        "opened_kept_last": opened_kept,
        "kept_shares": [shares_before, shares_after],  # before and after the writer's close
        "ack_spin_ms": ColocateConfig.from_env(env).ack_spin_ms,
        "packed_gb": packed / 1e9,
        "pieces": len(pieces),
        "bitwise": not wrong and not missing,
        "wrong": wrong[:5],
        "missing": missing[:5],
        "steps": args.steps,
    }


def reference_digests(pieces, local: dict, quantized) -> dict:  # type: ignore[no-untyped-def]
    """What SGLang should hold: the converter's own output cut to this GPU's boxes, and for the block-FP8
    pieces the reference quantizer's e4m3 values and scales of it (colocated/fp8_block.py)."""
    from colocate_runtime.colocated.fp8_block import quantize

    want = {}
    for p in pieces:
        if p.shard.name not in local:
            continue
        data = p.data()[local[p.shard.name].relative_to(p.shard.box).slices()]
        if p.shard.name in quantized:
            q, scale = quantize(data)
            want[p.shard.name], want[p.shard.name + SCALE_SUFFIX] = digest(q), digest(scale)
        else:
            want[p.shard.name] = digest(data)
    return want


def digest_runs(setting: str, step: int) -> bool:
    """Whether the weights check runs in `step`: always, never, or (both) in odd steps only, so that the
    steps with and without it interleave in one run (the first, untimed step checks: it compiles)."""
    return setting == "on" or (setting == "both" and step % 2 == 1)


def _share(descriptor: dict | None) -> tuple[object, ...]:
    """Which export a descriptor names: torch gives every export its own reference counter."""
    d = descriptor or {}
    return (d.get("handle"), d.get("ref_counter_handle"), d.get("ref_counter_offset"), d.get("file"))


def _count(descriptor: dict | None) -> int | None:
    d = descriptor or {}
    if "ref_counter_handle" not in d:
        return None
    from colocate_runtime.colocated.ipc import share_count

    return share_count(d["ref_counter_handle"], d["ref_counter_offset"])


def commit() -> str:
    """The commit measured: COLOCATE_BENCH_COMMIT where the checkout has no current .git (the GPU machine)."""
    if os.environ.get("COLOCATE_BENCH_COMMIT"):
        return os.environ["COLOCATE_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("bench", "reader"), default="bench")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["qwen3-30b-a3b-tp2ep8"])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=4, help="steps per mode; the first is a warm-up")
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--min-adopt-mb", type=int, default=256, help="smallest storage exported in place")
    p.add_argument(
        "--target-dtype",
        nargs="+",
        choices=TARGET_DTYPES,
        default=["bfloat16"],
        help="what SGLang holds: bfloat16, or block FP8 (quantized on the copy); several: one row each",
    )
    p.add_argument(
        "--fp8-cast",
        choices=("native", "integer"),
        default="native",
        help="block FP8: the GPU's own e4m3 conversion (default) or integer rounding (fp8_copy.NATIVE_CAST)",
    )
    p.add_argument(
        "--fp8-warps", type=int, default=0, help="block FP8: the kernel's warps (0: fp8_copy.WARPS)"
    )
    p.add_argument("--no-save", action="store_true", help="do not append to bench/results/step.jsonl")
    p.add_argument(
        "--via",
        choices=("writer", "publisher"),
        default="writer",
        help="inplace/kept: call the writer, or go through colocate_runtime.megatron.Publisher",
    )
    p.add_argument(
        "--digest",
        choices=("on", "off", "both"),
        default="on",
        help="the weights check of every step; both: in every other step, and its cost printed",
    )
    p.add_argument("--digest-period", type=int, default=1024, help="steps in which it covers every byte")
    args = p.parse_args()
    if args.role == "reader":
        run_reader(args)
        return
    command = "python bench/step_bench.py " + shlex.join(sys.argv[1:])
    print(f"# {command}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp))
        try:
            for name, target, mode in itertools.product(args.preset, args.target_dtype, args.modes):
                print(f"# {name} {target} {mode} ...", flush=True)
                row = run_mode(args, name, mode, target, server.port, server.password, Path(tmp))
                row.update(device=device_name(args.device), commit=commit(), command=command)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not args.no_save:
                    RESULTS.parent.mkdir(parents=True, exist_ok=True)
                    with RESULTS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            server.stop()
    print()
    head = (
        f"{'preset':<24}{'target':<10}{'mode':<10}{'GB':>7}{'ms':>9}{'floor':>8}{'x':>7}  phases ms (median)"
    )
    print(head)
    for r in rows:
        phases = " ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items() if v >= 0.05)
        print(
            f"{r['preset']:<24}{r['target_dtype'][:8]:<10}{r['mode']:<10}{r['gb']:>7.2f}{r['ms']:>9.1f}{r['floor_ms']:>8.1f}"
            f"{r['ms'] / r['floor_ms']:>7.1f}  {phases}  handles {r['handles']}"
            f" packed {r['packed_gb']:.2f} GB"
            f"  bitwise {'yes' if r['bitwise'] else 'NO ' + str(r['wrong'] + r['missing'])}"
        )
        if "digest_cost_ms" in r:
            print(
                f"{'':<24}weights check (period {r['digest_period']}): {r['ms']:.2f} ms with, "
                f"{r['digest_off_ms']:.2f} ms without: {r['digest_cost_ms']:+.3f} ms = "
                f"{r['digest_cost_pct']:+.2f} % of the step"
            )
    if not all(r["bitwise"] for r in rows):
        sys.exit("installed bytes differ from the reference conversion")


if __name__ == "__main__":
    main()
