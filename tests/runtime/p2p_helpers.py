"""Test support for the p2p executor: synthetic models and layouts, and multi-process worlds on gloo or NCCL.

Layouts follow the Megatron / SGLang conventions the real converters produce: column-parallel weights split
on dim 0, row-parallel on dim 1, norms replicated across tensor parallel ranks, layers split over pipeline
stages, experts split on dim 0 across expert-parallel ranks. Every process regenerates the same reference
tensors from a seed derived from the parameter name, so receivers check bitwise what they got.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from colocate_runtime.bits import bits as int_view
from colocate_runtime.bits import copy_bits
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.p2p.layout import Layout, ParamShards, split_box, split_extent
from colocate_runtime.shards import Box, stable_hash

# --- synthetic models ----------------------------------------------------------------------------------

COLUMN, ROW, REPLICATED, EXPERT = "column", "row", "replicated", "expert"


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str
    stage_key: float  # position in the layer order, for pipeline stages (-1 embedding, L head)


@dataclass(frozen=True)
class Model:
    params: tuple[Param, ...]
    num_layers: int

    def stage_of(self, p: Param, pp: int) -> int:
        bounds = split_extent(self.num_layers, pp)
        if p.stage_key < 0:
            return 0
        if p.stage_key >= self.num_layers:
            return pp - 1
        layer = int(p.stage_key)
        return next(s for s, (o, n) in enumerate(bounds) if o <= layer < o + n)


def dense_model(layers: int = 4, hidden: int = 12, ffn: int = 20, vocab: int = 26, heads: int = 3) -> Model:
    """A small decoder: sizes deliberately not divisible by common parallel degrees."""
    params = [Param("embed.weight", (vocab, hidden), COLUMN, -1)]
    head_dim = hidden // heads
    for i in range(layers):
        pre = f"layers.{i}."
        params += [
            Param(pre + "attn.qkv.weight", (3 * heads * head_dim, hidden), COLUMN, i),
            Param(pre + "attn.qkv.bias", (3 * heads * head_dim,), COLUMN, i),
            Param(pre + "attn.o.weight", (hidden, heads * head_dim), ROW, i),
            Param(pre + "mlp.up.weight", (ffn, hidden), COLUMN, i),
            Param(pre + "mlp.down.weight", (hidden, ffn), ROW, i),
            Param(pre + "norm.weight", (hidden,), REPLICATED, i),
        ]
    params += [
        Param("final_norm.weight", (hidden,), REPLICATED, layers),
        Param("head.weight", (vocab, hidden), COLUMN, layers),
        Param("step_scale", (), REPLICATED, layers),
    ]
    return Model(tuple(params), layers)


def moe_model(layers: int = 2, experts: int = 16, hidden: int = 8, ffn: int = 6) -> Model:
    params = [Param("embed.weight", (24, hidden), REPLICATED, -1)]
    for i in range(layers):
        pre = f"layers.{i}."
        params += [
            Param(pre + "experts.w13", (experts, 2 * ffn, hidden), EXPERT, i),
            Param(pre + "experts.w2", (experts, hidden, ffn), EXPERT, i),
            Param(pre + "router.weight", (experts, hidden), REPLICATED, i),
            Param(pre + "norm.weight", (hidden,), REPLICATED, i),
        ]
    return Model(tuple(params), layers)


def _box(p: Param, tp: int, tp_rank: int, ep: int, ep_rank: int) -> Box:
    if p.kind == COLUMN and tp > 1:
        return split_box(p.shape, 0, tp, tp_rank)
    if p.kind == ROW and tp > 1:
        return split_box(p.shape, 1, tp, tp_rank)
    if p.kind == EXPERT and ep > 1:
        return split_box(p.shape, 0, ep, ep_rank)
    return Box.full(p.shape)


def trainer_layout(
    model: Model,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int = 1,
    first_rank: int = 0,
    dtype: str = "bfloat16",
) -> Layout:
    """Rank = first_rank + ((dp_rank * pp + pp_rank) * tp + tp_rank); with ep > 1 (and tp = pp = 1) the
    expert-parallel rank is the data-parallel rank, as in Megatron's EP over the DP group."""
    holders: dict[str, list[tuple[int, Box]]] = {p.name: [] for p in model.params}
    for d in range(dp):
        for s in range(pp):
            for t in range(tp):
                rank = first_rank + (d * pp + s) * tp + t
                for p in model.params:
                    if model.stage_of(p, pp) == s:
                        holders[p.name].append((rank, _box(p, tp, t, ep, d % ep)))
    return Layout.of(ParamShards(p.name, p.shape, dtype, tuple(holders[p.name])) for p in model.params)


def inference_layout(
    model: Model,
    *,
    tp: int = 1,
    ep: int = 1,
    ranks: Sequence[int],
    dtype: str = "bfloat16",
    dtype_overrides: dict[str, str] | None = None,
) -> Layout:
    """Replicas of a TP (or EP) engine over `ranks`: replica d, local rank t sits on ranks[d * size + t]."""
    size = max(tp, ep)
    if len(ranks) % size:
        raise ValueError(f"{len(ranks)} ranks do not hold whole replicas of size {size}")
    overrides = dtype_overrides or {}
    params = []
    for p in model.params:
        shards = [(r, _box(p, tp, i % size, ep, i % size)) for i, r in enumerate(ranks)]
        dt = next((v for k, v in overrides.items() if k in p.name), dtype)
        params.append(ParamShards(p.name, p.shape, dt, tuple(sorted(shards, key=lambda s: s[0]))))
    return Layout.of(params)


# --- reference data ------------------------------------------------------------------------------------


def reference(name: str, shape: tuple[int, ...], dtype: str, *, bits: bool = False) -> torch.Tensor:
    """The same pseudo-random global tensor in every process (values exact in bf16). `bits`: random bit
    patterns instead, every fifth element a NaN with a random payload (a float copy may rewrite those)."""
    g = torch.Generator().manual_seed(int(stable_hash(name)[:8], 16))
    if not bits:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(torch_dtype(dtype))
    width = torch_dtype(dtype).itemsize
    half = 1 << (8 * width - 1)
    x = torch.randint(-half, half, shape, generator=g, dtype={2: torch.int16, 4: torch.int32}[width])
    x.view(-1)[::5] |= 0x7F81 if width == 2 else 0x7F800001  # exponent all ones, mantissa not zero
    return x.view(torch_dtype(dtype))


def dense_local(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, strided: bool
) -> torch.Tensor:
    """An uninitialised local tensor; `strided` gives a non-contiguous view (transposed or every other)."""
    if not strided or len(shape) == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        return torch.empty(2 * shape[0], dtype=dtype, device=device)[::2]
    return torch.empty(tuple(reversed(shape)), dtype=dtype, device=device).permute(
        *reversed(range(len(shape)))
    )


def local_tensors(
    layout: Layout, rank: int, device: torch.device, *, fill: bool, strided: bool, bits: bool = False
) -> dict[str, torch.Tensor]:
    out = {}
    for s in layout.rank_shards(rank).shards:
        t = dense_local(s.box.lengths, torch_dtype(s.dtype), device, strided)
        if fill:
            copy_bits(t, reference(s.name, s.global_shape, s.dtype, bits=bits)[s.box.slices()])
        else:
            t.fill_(-7777.0)  # any element the exchange misses stays visibly wrong
        out[s.name] = t
    return out


def mismatches(
    senders: Layout, receivers: Layout, rank: int, targets: dict[str, torch.Tensor], *, bits: bool = False
) -> list[str]:
    """This rank's receiver shards that differ bitwise from the reference (cast sender -> receiver)."""
    send = senders.by_name()
    bad = []
    for s in receivers.rank_shards(rank).shards:
        ref = reference(s.name, s.global_shape, send[s.name].dtype, bits=bits).to(torch_dtype(s.dtype))
        want = ref[s.box.slices()].contiguous()
        got = targets[s.name].cpu().contiguous()
        if got.shape != want.shape or not torch.equal(
            got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
        ):
            bad.append(s.name)
    return bad


# --- multi-process worlds ------------------------------------------------------------------------------


@dataclass
class WorldResult:
    results: list[Any]
    errors: dict[int, str] = field(default_factory=dict)


def _child(
    fn: Callable[..., Any], rank: int, world: int, backend: str, store_path: str, args: tuple, out: Any
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast can take shared GPUs down
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            out.put((rank, "ok", fn(rank, world, *args)))
        finally:
            if backend != "nccl":
                dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test with it
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(
    fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", timeout: float = 45.0
) -> WorldResult:
    """Run fn(rank, world, *args) in `world` processes joined by one process group; collect what each rank
    returned or raised. Processes still running at the deadline are killed and reported as hung."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "colocate_runtime.p2p.executor"])
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, backend, store_path, args, out), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: list[Any] = [None] * world
        errors: dict[int, str] = {}
        seen = 0
        deadline = time.monotonic() + timeout
        try:
            while seen < world:
                try:
                    rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    break
                seen += 1
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
        finally:
            for p in procs:
                p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        for r in range(world):
            if results[r] is None and r not in errors:
                errors[r] = "hung: no result before the deadline"
    return WorldResult(results, errors)


# --- the reshard scenario every executor test runs -----------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Which model moves between which layouts, and how the executor is configured."""

    model: Model
    trainer: dict[str, Any]
    inference: dict[str, Any]
    budget_bytes: int = 1 << 30
    pipeline_depth: int = 2
    strided_sources: bool = False
    strided_targets: bool = False
    runs: int = 1
    trace: bool = False
    budget_by_rank: dict[int, int] | None = None  # ranks configured differently (they agree on the smallest)
    direct_min_bytes: int | None = None  # slices this big get their own message (None: the default)
    bits: bool = False  # random bit patterns with NaN payloads instead of normal values (one dtype only)

    def layouts(self) -> tuple[Layout, Layout]:
        return trainer_layout(self.model, **self.trainer), inference_layout(self.model, **self.inference)


def reshard_worker(rank: int, world: int, scenario: Scenario) -> dict[str, Any]:
    from colocate_runtime.p2p.config import ExecutorConfig
    from colocate_runtime.p2p.executor import P2PExchange

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    senders, receivers = scenario.layouts()
    budget = (scenario.budget_by_rank or {}).get(rank, scenario.budget_bytes)
    env = {"COLOCATE_P2P_TRACE": "1"} if scenario.trace else {}
    overrides: dict[str, Any] = {"budget_bytes": budget, "pipeline_depth": scenario.pipeline_depth}
    if scenario.direct_min_bytes is not None:
        overrides["direct_min_bytes"] = scenario.direct_min_bytes
    config = ExecutorConfig.from_env(env, timeout_s=20.0, **overrides)
    exchange = P2PExchange.create(senders, receivers, device=device, config=config)
    sources = local_tensors(
        senders, rank, device, fill=True, strided=scenario.strided_sources, bits=scenario.bits
    )
    reports, bad, cuda_extra = [], [], []
    for _ in range(scenario.runs):
        targets = local_tensors(receivers, rank, device, fill=False, strided=scenario.strided_targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        reports.append(exchange.run(sources, targets))
        if device.type == "cuda":
            cuda_extra.append(torch.cuda.max_memory_allocated(device) - base)
        bad.append(mismatches(senders, receivers, rank, targets, bits=scenario.bits))
    # Sources must come through untouched (nothing may write into the sender's tensors), bit for bit.
    fresh = local_tensors(senders, rank, torch.device("cpu"), fill=True, strided=False, bits=scenario.bits)
    touched = [n for n, t in sources.items() if not torch.equal(int_view(t.cpu()), int_view(fresh[n]))]
    last = reports[-1]
    return {
        "plan_hash": exchange.plan.hash(),
        "n_chunks": last.n_chunks,
        "messages": sum(len(b.sends) + len(b.recvs) for c in exchange.schedule.chunks for b in c.batches),
        "batches_total": sum(len(c.batches) for c in exchange.schedule.chunks),
        "capacity": exchange.chunk_plan.capacity,
        "staging_bytes": [r.staging_bytes for r in reports],
        "received_in_place": last.received_in_place,
        "received_staged": last.received_staged,
        "sent_in_place": last.sent_in_place,
        "sent_staged": last.sent_staged,
        "cuda_extra_bytes": cuda_extra,  # the caching allocator's peak: staging plus small control tensors
        "bytes_sent": last.bytes_sent,
        "bytes_received": last.bytes_received,
        "bytes_local": last.bytes_local,
        "batches": last.batches,
        "mismatches": bad,
        "sources_touched": touched,
        "trace": [(e.chunk, e.round, e.peer, e.event) for e in last.trace],
        "expected_received": exchange.plan.received_bytes().get(rank, 0),
        "expected_sent": exchange.plan.sent_bytes().get(rank, 0),
    }


# --- workers that misbehave on purpose -----------------------------------------------------------------


def _small_exchange(
    rank: int, world: int, receivers_tp: int = 1, timeout_s: float = 20.0, direct_min_bytes: int = 4 << 20
) -> Any:
    from colocate_runtime.p2p.config import ExecutorConfig
    from colocate_runtime.p2p.executor import P2PExchange

    model = dense_model(layers=2)
    senders = trainer_layout(model, tp=world)
    receivers = inference_layout(model, tp=receivers_tp, ranks=range(world))
    config = ExecutorConfig(timeout_s=timeout_s, direct_min_bytes=direct_min_bytes)
    return P2PExchange.create(senders, receivers, config=config), model


def stall_worker(rank: int, world: int, stall_rank: int, stall_s: float) -> str:
    """`stall_rank` agrees on everything, then never posts its batches (a peer stuck in other work)."""
    exchange, _ = _small_exchange(rank, world, timeout_s=2.0)
    device = exchange.device
    sources = local_tensors(exchange.senders, rank, device, fill=True, strided=False)
    targets = local_tensors(exchange.receivers, rank, device, fill=False, strided=False)
    if rank == stall_rank:
        exchange._exchange = lambda *_: time.sleep(stall_s)
    started = time.monotonic()
    exchange.run(sources, targets)
    return f"returned after {time.monotonic() - started:.1f} s"


def bad_metadata_worker(rank: int, world: int, bad_rank: int) -> str:
    """`bad_rank` describes a receiver layout with a hole in it; the others describe it correctly."""
    from colocate_runtime.p2p.executor import P2PExchange

    model = dense_model(layers=2)
    senders = trainer_layout(model, tp=world)
    receivers = inference_layout(model, tp=1, ranks=range(world))
    if rank == bad_rank:
        senders = Layout.of(
            p
            if p.name != "layers.1.mlp.up.weight"
            else ParamShards(p.name, p.global_shape, p.dtype, p.shards[1:])
            for p in senders.params
        )
    P2PExchange.create(senders, receivers)
    return "created"


def mismatch_worker(rank: int, world: int, odd_rank: int) -> str:
    """`odd_rank` plans a valid but different reshard (another inference TP degree)."""
    _small_exchange(rank, world, receivers_tp=world if rank == odd_rank else 1)
    return "created"


def extra_param_worker(rank: int, world: int, odd_rank: int) -> str:
    """`odd_rank` describes one parameter more on both sides (a model built from another config)."""
    from colocate_runtime.p2p.executor import P2PExchange

    model = dense_model(layers=2)
    senders = trainer_layout(model, tp=world)
    receivers = inference_layout(model, tp=1, ranks=range(world))
    if rank == odd_rank:
        full = Box.full((4,))
        senders = Layout.of([*senders.params, ParamShards("zz.extra.bias", (4,), "bfloat16", ((0, full),))])
        extra = tuple((r, full) for r in range(world))
        receivers = Layout.of([*receivers.params, ParamShards("zz.extra.bias", (4,), "bfloat16", extra)])
    P2PExchange.create(senders, receivers)
    return "created"


def bad_tensor_worker(rank: int, world: int, bad_rank: int) -> tuple[str, list[str]]:
    """`bad_rank` hands over a target of the wrong shape; nobody may start sending, and no target may change
    (the others' in-place receives and local copies included). Returns the error and the targets written."""
    exchange, _ = _small_exchange(rank, world, direct_min_bytes=16)  # dense slices received in place
    device = exchange.device
    sources = local_tensors(exchange.senders, rank, device, fill=True, strided=False)
    targets = local_tensors(exchange.receivers, rank, device, fill=False, strided=False)
    if rank == bad_rank:
        targets["layers.0.attn.o.weight"] = targets["layers.0.attn.o.weight"][:, :-1]
    try:
        exchange.run(sources, targets)
        error = "ran"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return error, sorted(n for n, t in targets.items() if not bool((t == -7777.0).all()))
