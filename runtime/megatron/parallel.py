"""Megatron-core's parallel state, read once, turned into our `MegatronLayout` and `MegatronRank`.

Reading is separated from deciding: `read_parallel_state` is the only function that imports megatron-core;
`layout_of` is pure, so every rule here is tested without a Megatron process. Whatever a trainer's model shows
about itself (the MLA down projections split over TP or duplicated; the padded vocabulary) is read from the
model's own tensors, never guessed from defaults, and a layout we cannot mirror is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from colocate_runtime.convert.errors import ConvertError, UnsupportedLayoutError
from colocate_runtime.convert.layout import MegatronLayout, MegatronRank, PipelineLayout
from colocate_runtime.convert.spec import ModelDims
from colocate_runtime.convert.trainer import strip_wrappers, trainer_plan

MLA_DOWN = ("linear_kv_down_proj.weight", "linear_q_down_proj.weight")


@dataclass(frozen=True, slots=True)
class ParallelState:
    """What megatron-core's `parallel_state` and the model's TransformerConfig say about this rank."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    vpp: int  # model chunks per pipeline rank (1 without a virtual pipeline)
    num_layers: int
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    custom_pipeline: bool = False  # pipeline_model_parallel_layout or embedding-in-split accounting


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (each keeps it as `.module`)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def read_parallel_state(chunks: Sequence[torch.nn.Module]) -> ParallelState:
    """This rank's coordinates from megatron-core (initialized by the trainer) and the model's config."""
    from megatron.core import parallel_state as ps  # type: ignore[import-not-found]

    config = getattr(unwrap(chunks[0]), "config", None)
    if config is None:
        raise UnsupportedLayoutError("the model chunk has no `.config` (a megatron-core TransformerConfig)")
    custom = bool(getattr(config, "pipeline_model_parallel_layout", None)) or any(
        getattr(config, flag, False)
        for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    )
    return ParallelState(
        tp=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        vpp=len(chunks),
        num_layers=int(config.num_layers),
        first_stage_layers=getattr(config, "num_layers_in_first_pipeline_stage", None),
        last_stage_layers=getattr(config, "num_layers_in_last_pipeline_stage", None),
        custom_pipeline=custom,
    )


def pipeline_of(state: ParallelState) -> PipelineLayout | None:
    if state.custom_pipeline:
        raise UnsupportedLayoutError(
            "a custom pipeline layout (pipeline_model_parallel_layout, or embedding/loss accounted in the "
            "pipeline split) is not supported: use even stages or num_layers_in_first/last_pipeline_stage"
        )
    if state.pp == 1 and state.vpp == 1:
        return None
    if state.first_stage_layers is None and state.last_stage_layers is None:
        return PipelineLayout.even(state.num_layers, state.pp, state.vpp)
    return PipelineLayout.uneven(
        state.num_layers, state.pp, state.first_stage_layers, state.last_stage_layers, state.vpp
    )


def vocab_divisor(state: ParallelState, chunks: Sequence[torch.nn.Module], default: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * tp`; the model knows
    its padded size (GPTModel.vocab_size), so the divisor that gives exactly that size is padded / tp."""
    for chunk in chunks:
        padded = getattr(unwrap(chunk), "vocab_size", None)
        if isinstance(padded, int) and padded % state.tp == 0:
            return padded // state.tp
    return default


def named_tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A chunk's parameters and buffers as the converter reads them: the Parameter objects themselves (a
    moved parameter stays visible to a bound layout), wrapper prefixes kept (the converter strips them)."""
    state = chunk.state_dict(keep_vars=True)  # also holds `_extra_state` entries, which are not tensors
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


def layout_of(
    spec: ModelDims, state: ParallelState, tensors: Sequence[Mapping[str, torch.Tensor]], divisor: int
) -> tuple[MegatronLayout, MegatronRank]:
    """Our layout and rank for this Megatron rank; where the model's tensors decide a switch (MLA down
    projections split over TP or not), the one whose plan matches the tensors' shapes."""
    rank = MegatronRank(state.tp_rank, state.pp_rank, state.ep_rank, state.etp_rank)
    base: dict[str, Any] = {
        "tp": state.tp,
        "ep": state.ep,
        "etp": None if state.etp == state.tp else state.etp,
        "pipeline": pipeline_of(state),
        "vocab_divisor": divisor,
    }
    if spec.mla is None or state.tp == 1:
        return MegatronLayout(**base), rank
    held = {strip_wrappers(n): tuple(t.shape) for named in tensors for n, t in named.items()}
    expected = {}
    for split in (False, True):
        layout = MegatronLayout(**base, mla_down_split=split)
        shapes = _mla_down_shapes(spec, layout, rank)
        expected[split] = shapes
        if shapes and all(held.get(name) == shape for name, shape in shapes.items()):
            return layout, rank
    if not any(expected.values()) or not any(name in held for name in expected[False]):
        return MegatronLayout(**base), rank  # this rank holds no MLA layer (a pipeline stage without one)
    raise ConvertError(
        "the model's MLA down projections match neither layout: duplicated on every TP rank (Transformer-"
        f"Engine spec from 0.14) expects {expected[False]}, split over TP (local spec) expects "
        f"{expected[True]}, the model holds { {n: held.get(n) for n in expected[False]} }"
    )


def _mla_down_shapes(spec: ModelDims, layout: MegatronLayout, rank: MegatronRank) -> dict[str, tuple]:
    """Local name -> shape of every MLA down projection the rank's plan expects (first chunk's names)."""
    plan = trainer_plan(spec, layout, rank)
    return {
        name: param.shape
        for chunk in plan.chunks[:1]
        for param in chunk.params
        for name in param.names
        if name.endswith(MLA_DOWN)
    }
