"""Weights that map one to one: same layout on both sides, at most a split along one dimension."""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.convert.boxes import split_box
from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.layout import RankGroups, Role
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, Piece, SGLangParam, plain
from colocate_runtime.shards import Box


@dataclass(frozen=True)
class Direct:
    tensor: CanonicalTensor
    megatron_names: tuple[str, ...]  # layer-relative, preferred first
    sglang_name: str | None  # None: the parameter is fused on the SGLang side and placed by the owning block
    role: Role = Role.REPLICATED
    dim: int = 0
    unit: int = 1  # split granularity along `dim` (a head's rows), so no rank gets part of a head

    def __post_init__(self) -> None:
        if self.tensor.shape[self.dim] % self.unit:
            raise UnsupportedLayoutError(
                f"{self.tensor.name}: dimension {self.dim} of size {self.tensor.shape[self.dim]} is not "
                f"whole units of {self.unit}"
            )

    def box(self, groups: RankGroups) -> Box:
        if self.role is Role.REPLICATED:
            return Box.full(self.tensor.shape)
        group = groups.of(self.role)
        if self.unit > 1:
            units = list(self.tensor.shape)
            units[self.dim] //= self.unit
            box = split_box(self.tensor.name, units, self.dim, group)
            offsets, lengths = list(box.offsets), list(box.lengths)
            offsets[self.dim] *= self.unit
            lengths[self.dim] *= self.unit
            return Box(tuple(offsets), tuple(lengths))
        return split_box(self.tensor.name, self.tensor.shape, self.dim, group)

    def canonical(self) -> list[CanonicalTensor]:
        return [self.tensor]

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        box = self.box(groups)
        names = tuple(at + name for name in self.megatron_names)
        return [MegatronParam(names, box.lengths, (Piece(self.tensor.shard(box)),))]

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        if self.sglang_name is None:
            return []
        box = self.box(groups)
        return [plain(self.sglang_name, self.tensor.shard(box), box.lengths)]
