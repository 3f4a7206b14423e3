"""Gated MLPs (dense layers and shared experts).

Megatron's `linear_fc1` holds, per TP rank, [gate shard; up shard], so the halves are taken from the local
tensor (halving the gathered tensor would mix ranks). SGLang's `gate_up_proj` has the same per-rank layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from colocate_runtime.convert.boxes import split_box
from colocate_runtime.convert.layout import RankGroups, Role
from colocate_runtime.convert.params import (
    CanonicalTensor,
    MegatronParam,
    Piece,
    SGLangParam,
    plain,
    stacked_rows,
)
from colocate_runtime.shards import TensorShard

if TYPE_CHECKING:
    import torch


def first_half(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[: tensor.shape[0] // 2]


def second_half(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[tensor.shape[0] // 2 :]


@dataclass(frozen=True)
class GatedMLP:
    prefix: str  # canonical and SGLang module, e.g. "model.layers.0.mlp" or "...mlp.shared_experts"
    megatron_stem: str  # layer-relative, e.g. "mlp" or "mlp.shared_experts"
    hidden: int
    intermediate: int
    dtype: str
    role: Role = Role.MLP

    def _tensors(self) -> tuple[CanonicalTensor, CanonicalTensor, CanonicalTensor]:
        p, h, i = self.prefix, self.hidden, self.intermediate
        return (
            CanonicalTensor(f"{p}.gate_proj.weight", (i, h), self.dtype),
            CanonicalTensor(f"{p}.up_proj.weight", (i, h), self.dtype),
            CanonicalTensor(f"{p}.down_proj.weight", (h, i), self.dtype),
        )

    def canonical(self) -> list[CanonicalTensor]:
        return list(self._tensors())

    def _shards(self, groups: RankGroups) -> tuple[TensorShard, TensorShard, TensorShard]:
        group = groups.of(self.role)
        gate, up, down = self._tensors()
        return (
            gate.shard(split_box(gate.name, gate.shape, 0, group)),
            up.shard(split_box(up.name, up.shape, 0, group)),
            down.shard(split_box(down.name, down.shape, 1, group)),
        )

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        gate, up, down = self._shards(groups)
        rows = gate.box.lengths[0]
        return [
            MegatronParam(
                (f"{at}{self.megatron_stem}.linear_fc1.weight",),
                (2 * rows, self.hidden),
                (Piece(gate, first_half), Piece(up, second_half)),
            ),
            MegatronParam((f"{at}{self.megatron_stem}.linear_fc2.weight",), down.box.lengths, (Piece(down),)),
        ]

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        gate, up, down = self._shards(groups)
        return [
            stacked_rows(f"{self.prefix}.gate_up_proj.weight", [gate, up], (self.hidden,)),
            plain(f"{self.prefix}.down_proj.weight", down, down.box.lengths),
        ]
