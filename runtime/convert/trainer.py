"""Trainer side: a Megatron-core rank's tensors to canonical pieces with exact boxes.

`trainer_plan` is metadata only (what the rank holds, for planning and for hashing across ranks);
`TrainerRankPlan.convert` applies it to the rank's actual tensors. Inputs are checked strictly: a missing,
unknown or wrongly shaped tensor is an error naming it, never a silent skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from colocate_runtime.convert.errors import (
    ConvertError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from colocate_runtime.convert.layout import MegatronLayout, MegatronRank
from colocate_runtime.convert.params import MegatronParam, Piece
from colocate_runtime.convert.registry import stage_blocks
from colocate_runtime.convert.spec import ModelDims
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import RankShards, TensorShard

ConvertedPiece = tuple[TensorShard, torch.Tensor]


@dataclass(frozen=True)
class ModelChunkPlan:
    """One model chunk (virtual pipeline stage) of a trainer rank."""

    vp_stage: int
    layers: range  # global layer ids; Megatron names them decoder.layers.0 .. len - 1
    params: tuple[MegatronParam, ...]


@dataclass(frozen=True)
class TrainerRankPlan:
    spec: ModelDims
    layout: MegatronLayout
    rank: MegatronRank
    chunks: tuple[ModelChunkPlan, ...]

    def shards(self) -> list[TensorShard]:
        return [piece.shard for chunk in self.chunks for param in chunk.params for piece in param.pieces]

    def rank_shards(self, rank: int) -> RankShards:
        """This rank's sources for the transfer plan, under the plan's rank id."""
        return RankShards.of(rank, self.shards())

    def convert(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
    ) -> list[ConvertedPiece]:
        """Canonical pieces of this rank. `tensors` holds one name -> tensor mapping per model chunk (a bare
        mapping when there is no virtual pipeline), e.g. each chunk's `state_dict()` (buffers included, since
        `expert_bias` is a buffer). Data are views where the layout allows, cast to each shard's dtype."""
        chunks = self._chunks_of(tensors)
        out: list[ConvertedPiece] = []
        with torch.no_grad():
            for plan, named in zip(self.chunks, chunks, strict=True):
                out += self._convert_chunk(plan, named)
        return out

    def bind(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
    ) -> list[BoundPiece]:
        """Each canonical piece of this rank tied to the local tensor it comes from (checked like `convert`),
        without extracting anything: the one-pass update reads the pieces where they lie, once per layout."""
        chunks = self._chunks_of(tensors)
        return [
            BoundPiece(piece, tensor)
            for plan, named in zip(self.chunks, chunks, strict=True)
            for tensor, param in self._choose(plan, named)
            for piece in param.pieces
        ]

    def _chunks_of(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Mapping[str, torch.Tensor]]:
        chunks = [tensors] if isinstance(tensors, Mapping) else list(tensors)
        if len(chunks) != len(self.chunks):
            raise ConvertError(
                f"trainer rank {self.rank}: got {len(chunks)} model chunk(s), layout has {len(self.chunks)}"
            )
        return chunks

    def _convert_chunk(
        self, plan: ModelChunkPlan, tensors: Mapping[str, torch.Tensor]
    ) -> list[ConvertedPiece]:
        # The hot loop of a weight sync (tens of thousands of tensors): no work beyond the extract and a cast.
        out = []
        for tensor, param in self._choose(plan, tensors):
            for piece in param.pieces:
                data = piece.extract(tensor)
                dtype = torch_dtype(piece.shard.dtype)
                out.append((piece.shard, data if data.dtype == dtype else data.to(dtype)))
        return out

    def _choose(
        self, plan: ModelChunkPlan, tensors: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, MegatronParam]]:
        """The local tensor of each parameter; a missing, unknown or misshapen one is an error."""
        where = f"trainer rank {self.rank} chunk {plan.vp_stage}"
        named = {strip_wrappers(name): t for name, t in tensors.items() if not name.endswith("_extra_state")}
        chosen: list[tuple[torch.Tensor, MegatronParam]] = []
        used: set[str] = set()
        missing = []
        for param in plan.params:
            for name in param.names:
                if name in named:
                    tensor = named[name]
                    if tensor.shape != param.shape:
                        raise ShapeMismatchError(
                            name, param.shape, tuple(tensor.shape), f"{where} of {self.layout}"
                        )
                    chosen.append((tensor, param))  # not detached: a moved parameter stays visible (bind)
                    used.add(name)
                    break
            else:
                if not param.optional:
                    missing.append(param.names[0])
        if missing:
            unclaimed = [f"{n} {tuple(named[n].shape)}" for n in sorted(set(named) - used)]
            raise MissingTensorError(where, missing, unclaimed)
        if len(used) != len(named):
            raise UnexpectedTensorError(where, sorted(set(named) - used))
        return chosen


@dataclass(frozen=True, slots=True)
class BoundPiece:
    """One canonical piece of a trainer rank and the local tensor it is cut from."""

    piece: Piece
    tensor: torch.Tensor

    @property
    def shard(self) -> TensorShard:
        return self.piece.shard

    def data(self) -> torch.Tensor:
        """The piece's data (a view where the layout allows, else a copy), in the canonical dtype."""
        data = self.piece.extract(self.tensor.detach())
        dtype = torch_dtype(self.piece.shard.dtype)
        return data if data.dtype == dtype else data.to(dtype)

    def view(self) -> torch.Tensor | None:
        """A view of the local tensor whose row-major order is the piece's data, or None where the data
        cannot be read in place (a dtype cast, or a layout only a copy produces)."""
        if self.tensor.dtype != torch_dtype(self.piece.shard.dtype):
            return None
        tensor = self.tensor.detach()  # of the parameter as it is now (bound: the object, not a copy)
        if self.piece.view is not None:
            return self.piece.view(tensor)
        data = self.piece.extract(tensor)
        same = data.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        return data if same else None


def strip_wrappers(name: str) -> str:
    """DDP and Float16Module prefix parameter names with `module.` (possibly twice)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def trainer_plan(spec: ModelDims, layout: MegatronLayout, rank: MegatronRank) -> TrainerRankPlan:
    """What trainer rank `rank` holds, as canonical boxes (no tensors needed)."""
    pipeline = layout.pipeline_for(spec)
    groups = layout.groups(spec, rank)
    chunks = []
    for vp in range(pipeline.vpp):
        layers = pipeline.layers(rank.pp_rank, vp)
        local = {layer: i for i, layer in enumerate(layers)}
        blocks = stage_blocks(
            spec, layers, pipeline.is_first(rank.pp_rank, vp), pipeline.is_last(rank.pp_rank, vp)
        )
        params = tuple(
            param
            for layer, block in blocks
            for param in block.megatron(groups, "" if layer is None else f"decoder.layers.{local[layer]}.")
        )
        chunks.append(ModelChunkPlan(vp, layers, params))
    plan = TrainerRankPlan(spec, layout, rank, tuple(chunks))
    names = [shard.name for shard in plan.shards()]
    if len(set(names)) != len(names):  # the transfer plan addresses a rank's piece by name alone
        raise ConvertError(f"trainer rank {rank}: a canonical tensor is produced twice")
    return plan


def convert_trainer_rank(
    spec: ModelDims,
    layout: MegatronLayout,
    rank: MegatronRank,
    tensors: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
) -> list[ConvertedPiece]:
    return trainer_plan(spec, layout, rank).convert(tensors)
