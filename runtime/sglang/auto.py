"""The SGLang side's wiring without a user module: targets, target shards and (when needed) the cross-GPU
exchange, built at the first update of each TP worker from what both sides already state.

- the trainer rank publishing on this worker's GPU: its `TrainerRecord` (convert/published.py), which the
  trainer facade writes into the meta-store at start under the GPU's UUID (the writer's `uuid`);
- the engine's model: `model.config` (the transformers config SGLang loaded) -> `registry.model_spec`, with
  the record's dtype, its architecture checked against the record's;
- the engine's sharding: SGLang's own server arguments as this worker sees them (`EngineArgs`: TP,
  `--ep-size`, DP attention, `--enable-dp-lm-head`, `--moe-dense-tp-size`) -> `SGLangLayout`; the TP rank
  from its group.

The decision is collective (creating the exchange is, so every worker must take the same branch): each worker
states its trainer shards and its targets over the loader's exchange group, every worker sees all of them, and
- every target of every worker lies inside the trainer shard published on that worker's own GPU: the local
  path (each target is cut from the GPU's own buckets, `target_shards` say which box it is);
- otherwise (Megatron pads the vocabulary to make_vocab_size_divisible_by x TP, SGLang to 64; the TP sizes
  differ; pipeline stages) the reshard exchange moves what other GPUs publish (colocated/exchange.py).
A failure on any worker (no record, a model or layout mismatch) is raised on every worker, naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.exchange import allgather_json as exchange_allgather_json
from colocate_runtime.colocated.fp8_block import BlockFp8
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.colocated.wiring import reshard_exchange
from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.fp8 import Fp8Quantization, fp8_quantization, read_fp8
from colocate_runtime.convert.inference import InferenceRankPlan, inference_plan
from colocate_runtime.convert.layout import SGLangLayout
from colocate_runtime.convert.published import TrainerRecord, dims_differences, dims_of
from colocate_runtime.convert.registry import model_spec
from colocate_runtime.convert.trainer import TrainerRankPlan, trainer_plan
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.shards import Box, RankShards, TensorShard

if TYPE_CHECKING:
    from colocate_runtime.colocated.exchange import ReshardExchange

log = logging.getLogger(__name__)

SGLANG_VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE of sglang/srt/layers/vocab_parallel_embedding.py
RECORD_WRITER = "the trainer facade (colocate_runtime.megatron.Publisher) at its start, before any publish"


class AutoWiringError(RuntimeError):
    """The automatic wiring cannot be built (on this worker or another one); the message says why."""


# --- what SGLang's server arguments say about weight sharding -----------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """SGLang's server arguments that decide how a worker's weights are sharded (resolved values)."""

    tp: int
    pp: int = 1
    ep: int = 1  # --ep-size
    attn_dp: int = 1  # attention data parallelism (--dp-size with --enable-dp-attention; 0.5.23 attn_dp_size)
    attn_cp: int = 1
    moe_dp: int = 1
    dp_lm_head: bool = False  # --enable-dp-lm-head
    moe_dense_tp: int | None = None  # --moe-dense-tp-size
    vocab_padding: int = SGLANG_VOCAB_PADDING
    source: str = field(default="given", compare=False)  # where they were read (for the log line)

    def layout(self) -> SGLangLayout:
        """The `SGLangLayout` of these arguments; what the converters cannot place is refused by name."""
        refused = [
            (self.pp, "--pp-size", "pipeline stages (each worker would hold only some layers)"),
            (self.attn_cp, "attention context parallelism", "an attention-CP split of the heads"),
            (self.moe_dp, "--moe-dp-size", "MoE data parallelism"),
        ]
        for size, flag, what in refused:
            if size != 1:
                raise UnsupportedLayoutError(
                    f"SGLang runs with {flag} {size}: the automatic colocated loader does not place weights "
                    f"for {what}; run without it or set the loader's resolvers yourself"
                )
        return SGLangLayout(
            tp=self.tp,
            ep=self.ep,
            dp_attention=self.attn_dp,
            dp_lm_head=self.dp_lm_head,
            moe_dense_tp=self.moe_dense_tp,
            vocab_padding=self.vocab_padding,
        )


def _int(obj: Any, name: str, default: int) -> int:
    value = getattr(obj, name, None)
    return default if value is None else int(value)


def engine_args_from_server_args(args: Any) -> EngineArgs:
    """SGLang <= 0.5.2x's `ServerArgs` (0.5.10: `server_args.get_global_server_args()`): DP attention is
    `--enable-dp-attention` with its size in `dp_size`."""
    dp_attention = bool(getattr(args, "enable_dp_attention", False))
    return EngineArgs(
        tp=_int(args, "tp_size", 1),
        pp=_int(args, "pp_size", 1),
        ep=_int(args, "ep_size", 1),
        attn_dp=_int(args, "dp_size", 1) if dp_attention else 1,
        attn_cp=_int(args, "attn_cp_size", 1),
        moe_dp=_int(args, "moe_dp_size", 1),
        dp_lm_head=bool(getattr(args, "enable_dp_lm_head", False)),
        moe_dense_tp=getattr(args, "moe_dense_tp_size", None),
        vocab_padding=_vocab_padding(),
        source="server_args.get_global_server_args()",
    )


def engine_args_from_parallel(parallel: Any) -> EngineArgs:
    """SGLang 0.5.23's resolved parallel namespace (`runtime_context.get_parallel()`): DP attention is
    `attn_dp_size` (the deprecated `--dp-size N --enable-dp-attention` resolves to it)."""
    return EngineArgs(
        tp=_int(parallel, "tp_size", 1),
        pp=_int(parallel, "pp_size", 1),
        ep=_int(parallel, "ep_size", 1),
        attn_dp=_int(parallel, "attn_dp_size", 1),
        attn_cp=_int(parallel, "attn_cp_size", 1),
        moe_dp=_int(parallel, "moe_dp_size", 1),
        dp_lm_head=bool(getattr(parallel, "enable_dp_lm_head", False)),
        moe_dense_tp=getattr(parallel, "moe_dense_tp_size", None),
        vocab_padding=_vocab_padding(),
        source="runtime_context.get_parallel()",
    )


def _vocab_padding() -> int:
    try:
        from sglang.srt.layers.vocab_parallel_embedding import (  # type: ignore[import-not-found]
            DEFAULT_VOCAB_PADDING_SIZE,
        )

        return int(DEFAULT_VOCAB_PADDING_SIZE)
    except (ImportError, AttributeError):
        return SGLANG_VOCAB_PADDING


def read_engine_args(tp_size: int) -> EngineArgs:
    """This worker's SGLang arguments: 0.5.23's resolved parallel namespace where it exists, else the global
    `ServerArgs` (0.5.10). Outside SGLang (tests, the stand-in): a plain TP engine of `tp_size` workers."""
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found]

        parallel = get_parallel()
        if int(parallel.tp_size) > 0:  # raises where nothing was published in this process
            return engine_args_from_parallel(parallel)
    except (ImportError, AttributeError, RuntimeError, ValueError):
        pass
    try:
        from sglang.srt.server_args import get_global_server_args  # type: ignore[import-not-found]

        return engine_args_from_server_args(get_global_server_args())
    except (ImportError, AttributeError, RuntimeError, ValueError):  # 0.5.23 retired it (RuntimeError)
        pass
    return EngineArgs(tp=tp_size, source=f"no SGLang arguments here: a plain TP engine of {tp_size}")


# --- the model and the record -------------------------------------------------------------------------------


def hf_config_of(model: torch.nn.Module) -> dict[str, Any]:
    """The transformers config SGLang built the model from (`model.config`), as a dict."""
    config = getattr(model, "config", None)
    if config is None:
        raise AutoWiringError(
            f"the model ({type(model).__name__}) has no `config`: the automatic loader reads the model's "
            "transformers config from it; set the loader's target resolver instead"
        )
    if isinstance(config, Mapping):
        return dict(config)
    return dict(config.to_dict())


def record_key(cfg: ColocateConfig, uuid: str) -> str:
    return KeySchema(cfg.namespace, cfg.job).trainer_record(uuid)


def wait_for_record(store: MetaStore, cfg: ColocateConfig, uuid: str, timeout_s: float) -> TrainerRecord:
    """The trainer record of GPU `uuid`, waiting up to `timeout_s` for the trainer to write it."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = store.read_trainer_record(uuid)
        if text is not None:
            return TrainerRecord.from_json(text)
        if time.monotonic() >= deadline:
            raise AutoWiringError(
                f"no trainer record for this GPU: key {record_key(cfg, uuid)} is missing after "
                f"{timeout_s:.0f} s (written by {RECORD_WRITER}); trainer records exist for other GPUs "
                "of this engine, so the trainer rank on this GPU did not start, or runs in another job or "
                "namespace"
            )
        time.sleep(0.1)


@dataclass(frozen=True)
class RankPlans:
    """Both sides' plans on one GPU: the trainer rank publishing there and the SGLang worker reading there."""

    trainer: TrainerRankPlan
    inference: InferenceRankPlan
    engine: EngineArgs


def rank_plans(
    record: TrainerRecord, config: Mapping[str, Any], engine: EngineArgs, tp_rank: int
) -> RankPlans:
    """Pure: the trainer rank's plan from its record and the worker's plan from SGLang's model and arguments,
    with the model's architecture checked against what the trainer publishes."""
    spec = model_spec(config, dtype=record.dtype)
    if spec.architecture != record.architecture:
        raise AutoWiringError(
            f"the trainer publishes a {record.architecture!r} model, SGLang serves {spec.architecture!r} "
            f"(model_type {config.get('model_type')!r}): both sides must run the same model"
        )
    differ = [] if record.dims is None else dims_differences(record.dims, dims_of(spec))
    if differ:
        raise AutoWiringError(
            "SGLang's model config differs from the trainer's: "
            + "; ".join(differ[:4])
            + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else "")
            + ". Both sides must load the same config; SGLang also rewrites some sizes itself (on CPU it "
            "pads an expert intermediate size that does not split evenly over TP): this update cannot follow"
        )
    return RankPlans(
        trainer_plan(spec, record.layout, record.rank),
        inference_plan(spec, engine.layout(), tp_rank),
        engine,
    )


# --- the collective decision --------------------------------------------------------------------------------


def uncovered(trainer: Layout, inference: Layout) -> list[str]:
    """Pure: every worker's targets that the trainer shard published on its own GPU does not hold whole (rank
    r of both layouts is the worker of group rank r). Empty: the local path suffices."""
    held = {(r, p.name): (box, p) for p in trainer.params for r, box in p.shards}
    out = []
    for p in inference.params:
        for r, box in p.shards:
            source = held.get((r, p.name))
            if source is None:
                out.append(f"worker {r} needs {p.name}{_slices(box)}; it is not published on its GPU")
                continue
            tbox, tparam = source
            if (tparam.global_shape, tparam.dtype) != (p.global_shape, p.dtype):
                raise AutoWiringError(
                    f"{p.name}: the trainer publishes {tparam.dtype} {list(tparam.global_shape)}, SGLang "
                    f"needs {p.dtype} {list(p.global_shape)}"
                )
            if not tbox.contains(box):
                out.append(
                    f"worker {r} needs {p.name}{_slices(box)}; the trainer rank on its GPU holds "
                    f"{_slices(tbox)}"
                )
    return out


def _slices(box: Box) -> str:
    """A box as the slices a user would write: [160:300, 0:64]."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths, strict=True)) + "]"


def allgather_json(obj: Any, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """Collective: every group rank's JSON-able `obj`, in rank order. Without a group: this process alone."""
    return [obj] if group is None else exchange_allgather_json(obj, group, device)


@dataclass
class AutoWiring:
    """What the loader builds its reader from (`new_reader(cfg, targets, rank=..., target_shards=...,
    exchange=...)`); `exchange` None: the local path."""

    targets: dict[str, torch.Tensor]
    target_shards: dict[str, TensorShard]
    exchange: ReshardExchange | None
    path: str  # "local" or "exchange"
    reason: str
    # A block-FP8 engine: each e4m3 target's `weight_scale_inv` view, and the scales' format
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    fp8_format: BlockFp8 | None = None


@dataclass(frozen=True)
class Worker:
    """Where the wiring runs: the worker's rank in its TP group (= in `group`); `group`, the TP workers the
    decision is gathered over (None: this process alone); the device of the exchange (None: CPU); its GPU's
    UUID; and `exchange_group`, which creates (collectively, only on the exchange path) the group the
    exchange runs on. The decision needs a few small all-gathers once: on a CPU (gloo) group, so the local
    path never initialises an NCCL communicator it would not use."""

    rank: int
    group: dist.ProcessGroup | None
    device: torch.device | None
    uuid: str
    exchange_group: Callable[[], dist.ProcessGroup] | None = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def collective_device(self) -> torch.device:
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return self.device or torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def automatic_wiring(
    model: torch.nn.Module,
    cfg: ColocateConfig,
    store: MetaStore,
    worker: Worker,
    engine: EngineArgs | None = None,
) -> AutoWiring | None:
    """Collective over `worker.group`: the wiring of this worker, or None when no GPU of the group has a
    trainer record (the trainer publishes SGLang's own parameter names: the loader's default). Raises
    AutoWiringError on every worker when any worker cannot be wired."""
    device = worker.collective_device()
    own: dict[str, Any] = {"error": None}
    text = None
    try:
        text = store.read_trainer_record(worker.uuid)
    except Exception as err:  # still vote: the other workers are waiting for this one in the gathers
        own["error"] = f"the trainer record could not be read: {type(err).__name__}: {err}"
    votes = allgather_json(text is not None or own["error"] is not None, worker.group, device)
    if not any(votes):
        return None
    plans = None
    try:
        if own["error"] is not None:
            raise AutoWiringError(own["error"])
        record = (
            TrainerRecord.from_json(text)
            if text is not None
            else wait_for_record(store, cfg, worker.uuid, cfg.step_timeout_s)
        )
        plans = _checked_plans(model, record, engine or read_engine_args(worker.size), worker)
        own["trainer"] = plans.trainer.rank_shards(worker.rank).to_json()
        own["targets"] = plans.inference.rank_shards(worker.rank).to_json()
    except Exception as err:  # every worker must reach the gather below, whatever went wrong here
        own["error"] = f"{type(err).__name__}: {err}"
    everyone = allgather_json(own, worker.group, device)
    failed = [f"worker {r}: {s['error']}" for r, s in enumerate(everyone) if s["error"]]
    if failed:
        raise AutoWiringError("automatic colocated wiring failed on " + "; ".join(failed))
    assert plans is not None  # this worker's entry had no error
    trainer = Layout.from_ranks(RankShards.from_json(s["trainer"]) for s in everyone)
    inference = Layout.from_ranks(RankShards.from_json(s["targets"]) for s in everyone)
    return _wire(model, cfg, worker, plans, trainer, inference)


def engine_fp8(hf_config: Mapping[str, Any], declared: str) -> Fp8Quantization | None:
    """The engine's block-FP8 quantization from its model config (None: it holds the model dtype), checked
    against what the job declared (`COLOCATE_ROLLOUT_WEIGHTS`). The scale format is the engine's GPU's:
    UE8M0 where SGLang's DeepGEMM asks for it."""
    try:
        quant = fp8_quantization(hf_config)
    except UnsupportedLayoutError as err:
        raise AutoWiringError(f"SGLang's model config: {err}") from None
    says = "block FP8" if quant is not None else "the model dtype (no block-FP8 quantization_config)"
    if (declared == "BlockFP8" and quant is None) or (declared == "BF16" and quant is not None):
        raise AutoWiringError(
            f"the job declares weightSync.rolloutWeights={declared}, SGLang's model config says {says}: "
            "serve the checkpoint the job declares, or change the declaration"
        )
    if quant is None:
        return None
    return replace(quant, ue8m0=_deepgemm_wants_ue8m0())


def _deepgemm_wants_ue8m0() -> bool:
    """SGLang's own switch (deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0: DeepGEMM on sm100/sm120), else False."""
    try:
        from sglang.srt.layers import deep_gemm_wrapper  # type: ignore[import-not-found]
    except Exception:  # no SGLang here, or one without DeepGEMM: fp32 scales
        return False
    return bool(getattr(deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", False))


def _checked_plans(
    model: torch.nn.Module, record: TrainerRecord, engine: EngineArgs, worker: Worker
) -> RankPlans:
    if engine.tp != worker.size:
        raise AutoWiringError(
            f"SGLang's arguments say TP {engine.tp}, this worker's TP group has {worker.size} ranks"
        )
    plans = rank_plans(record, hf_config_of(model), engine, worker.rank)
    plans.inference.check(dict(model.named_parameters()))
    return plans


def _wire(
    model: torch.nn.Module,
    cfg: ColocateConfig,
    worker: Worker,
    plans: RankPlans,
    trainer: Layout,
    inference: Layout,
) -> AutoWiring:
    """The branch every worker takes alike (it decides on the gathered layouts, the same everywhere)."""
    params = dict(model.named_parameters())
    quant = engine_fp8(hf_config_of(model), cfg.rollout_weights)
    scales: dict[str, torch.Tensor] = {}
    if quant is None:
        targets = {shard.name: view for shard, view in plans.inference.read(params)}
    else:
        targets, scales = read_fp8(plans.inference, params, quant)
    shards = {shard.name: shard for shard in plans.inference.shards()}
    fmt = BlockFp8(quant.block, quant.ue8m0) if quant is not None else None
    record = plans.trainer
    sides = (
        f"trainer Megatron tp={record.layout.tp} ep={record.layout.ep} etp={record.layout.expert_tp} "
        f"vocab_divisor={record.layout.vocab_divisor}; SGLang {plans.inference.layout}, from "
        f"{plans.engine.source}"
    )
    missing = uncovered(trainer, inference)
    if not missing:
        reason = f"every worker's targets are published on its own GPU ({sides})"
        log.info("colocated: automatic wiring, worker %d: local path: %s", worker.rank, reason)
        return AutoWiring(targets, shards, None, "local", reason, scales, fmt)
    if quant is not None:
        raise AutoWiringError(
            f"the targets need slices published on other GPUs ({missing[0]}), and a block-FP8 engine is "
            "written only from its own GPU's trainer rank (quantizing slices gathered from other GPUs is not "
            "implemented): give the trainer and SGLang the same tensor parallelism"
        )
    if worker.exchange_group is None:
        raise AutoWiringError(
            f"the targets need slices published on other GPUs ({missing[0]}), and the cross-GPU exchange "
            "needs SGLang's TP group, which this process does not have"
        )
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    reason = f"{len(missing)} target(s) need slices from other GPUs, e.g. {missing[0]}{more} ({sides})"
    log.info("colocated: automatic wiring, worker %d: exchange path: %s", worker.rank, reason)
    group = worker.exchange_group()  # collective: every worker takes this branch
    exchange = reshard_exchange(cfg, trainer, inference, group=group, device=worker.device)
    return AutoWiring(targets, exchange.target_shards(), exchange, "exchange", reason)
