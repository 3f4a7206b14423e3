"""Inference side: which canonical boxes an SGLang rank needs, and writing received pieces into its
parameters (fused `qkv_proj`, `gate_up_proj`, `w13_weight`/`w2_weight`, `fused_qkv_a_proj_with_mqa`, padded
vocabulary) in place.

A received piece may be any sub-box of a target box (the transfer plan cuts targets at trainer shard
boundaries). After writing, models that derive tensors from their weights (DeepSeek's `w_kc`/`w_vc` from
`kv_b_proj`) must run their post-load step, as SGLang does after `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from colocate_runtime.bits import copy_bits, foreach_copy_bits
from colocate_runtime.convert.errors import ConvertError, MissingTensorError, ShapeMismatchError
from colocate_runtime.convert.layout import SGLangLayout
from colocate_runtime.convert.params import Placement, SGLangParam
from colocate_runtime.convert.registry import stage_blocks
from colocate_runtime.convert.spec import ModelDims
from colocate_runtime.shards import RankShards, TensorShard


@dataclass(frozen=True)
class InferenceRankPlan:
    spec: ModelDims
    layout: SGLangLayout
    tp_rank: int
    params: tuple[SGLangParam, ...]

    @cached_property
    def _targets(self) -> dict[str, tuple[str, Placement]]:
        targets: dict[str, tuple[str, Placement]] = {}
        for param in self.params:
            for placement in param.placements:
                if placement.shard.name in targets:
                    raise ConvertError(f"{placement.shard.name} lands twice on SGLang rank {self.tp_rank}")
                targets[placement.shard.name] = (param.name, placement)
        return targets

    def shards(self) -> list[TensorShard]:
        """The canonical boxes this rank must receive (its targets in the transfer plan)."""
        return [placement.shard for _, placement in self._targets.values()]

    def rank_shards(self, rank: int) -> RankShards:
        return RankShards.of(rank, self.shards())

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {param.name: param.shape for param in self.params}

    def check(self, params: Mapping[str, torch.Tensor]) -> None:
        """The model's parameters are the ones this plan writes into, with the local shapes it expects."""
        where = f"SGLang rank {self.tp_rank} of {self.layout}"
        missing = [name for name in self.param_shapes() if name not in params]
        if missing:
            raise MissingTensorError(where, missing)
        for name, shape in self.param_shapes().items():
            if tuple(params[name].shape) != shape:
                raise ShapeMismatchError(name, shape, tuple(params[name].shape), where)

    def write(self, params: Mapping[str, torch.Tensor], piece: TensorShard, data: torch.Tensor) -> None:
        """Copy a received canonical piece (any sub-box of a target) into the parameter that holds it."""
        with torch.no_grad():
            copy_bits(self.destination(params, piece, data), data)

    def write_many(
        self, params: Mapping[str, torch.Tensor], pieces: Iterable[tuple[TensorShard, torch.Tensor]]
    ) -> None:
        """`write` for many pieces at once: one batched copy, not a kernel launch per piece (bitwise)."""
        destinations, sources = [], []
        for piece, data in pieces:
            destinations.append(self.destination(params, piece, data))
            sources.append(data)
        with torch.no_grad():
            foreach_copy_bits(destinations, sources)

    def destination(
        self, params: Mapping[str, torch.Tensor], piece: TensorShard, data: torch.Tensor
    ) -> torch.Tensor:
        """The view of the SGLang parameter that a received piece fills, after checking that it fits."""
        try:
            name, placement = self._targets[piece.name]
        except KeyError:
            raise ConvertError(f"SGLang rank {self.tp_rank} holds no part of {piece.name}") from None
        if piece.global_shape != placement.shard.global_shape:
            raise ShapeMismatchError(
                piece.name, placement.shard.global_shape, piece.global_shape, "global shape"
            )
        if data.shape != piece.box.lengths:
            raise ShapeMismatchError(
                piece.name, piece.box.lengths, tuple(data.shape), f"data for box {piece.box}"
            )
        return params[name][placement.target(piece.box)]

    def read(self, params: Mapping[str, torch.Tensor]) -> list[tuple[TensorShard, torch.Tensor]]:
        """The canonical pieces this rank holds, as views of its parameters (for checks and reverse syncs)."""
        return [
            (placement.shard, params[name][placement.target(placement.shard.box)])
            for name, placement in self._targets.values()
        ]


def inference_plan(spec: ModelDims, layout: SGLangLayout, tp_rank: int) -> InferenceRankPlan:
    """What SGLang TP rank `tp_rank` holds: its parameters and where each canonical box lands in them."""
    groups = layout.groups(spec, tp_rank)
    blocks = stage_blocks(spec, range(spec.num_layers), first=True, last=True)
    params = tuple(param for _, block in blocks for param in block.sglang(groups))
    return InferenceRankPlan(spec, layout, tp_rank, params)
