"""The records that tie each side's local tensors to boxes of canonical tensors.

Trainer side: a `MegatronParam` is one local Megatron tensor; each of its `Piece`s is a box of one canonical
tensor plus the function that cuts that box out of the local tensor (a view where the layout allows).
Inference side: an `SGLangParam` is one local SGLang parameter; each `Placement` says where a canonical box
lands inside it. Only the shard metadata is exchanged between ranks; the functions stay local.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colocate_runtime.shards import Box, ShardError, TensorShard

if TYPE_CHECKING:
    import torch

Extract = Callable[["torch.Tensor"], "torch.Tensor"]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    """A parameter in canonical form: Hugging Face style name, unfused, vocabulary trimmed."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def shard(self, box: Box | None = None) -> TensorShard:
        return TensorShard(self.name, self.shape, self.dtype, box or Box.full(self.shape))


@dataclass(frozen=True, slots=True)
class Piece:
    shard: TensorShard
    extract: Extract = whole  # local tensor -> data of shape shard.box.lengths
    # Where `extract` must copy (interleaved q/k/v groups): a view of the local tensor whose row-major order
    # is the data's, so the one-pass update copies from the trainer's storage directly. None: no such view.
    view: Extract | None = None


@dataclass(frozen=True, slots=True)
class MegatronParam:
    names: tuple[str, ...]  # accepted Megatron-core names, preferred first (TE fused vs. local modules)
    shape: tuple[int, ...]  # local shape on this rank
    pieces: tuple[Piece, ...]
    optional: bool = False  # e.g. the tied output layer copy that only exists on a last stage with PP > 1


@dataclass(frozen=True, slots=True)
class Placement:
    """Canonical box `shard.box` lands in the parameter at `index` (fixed leading indices, e.g. the local
    expert) followed by `offsets` in the remaining dimensions, which match the canonical ones one to one."""

    shard: TensorShard
    offsets: tuple[int, ...]
    index: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.offsets) != self.shard.box.ndim:
            raise ShardError(f"{self.shard.name}: placement offsets {self.offsets} do not match its box")

    def target(self, box: Box) -> tuple[int | slice, ...]:
        """The parameter's index expression for a sub-box of this placement's box (a received piece).

        Called once per received piece in every weight sync, so it is plain arithmetic (no Box objects)."""
        home = self.shard.box
        if box == home:
            starts, lengths = self.offsets, home.lengths
        else:
            if box.ndim != home.ndim or not home.contains(box):
                raise ShardError(f"{self.shard.name}: received box {box} is outside this rank's box {home}")
            starts = tuple(o + b - h for o, b, h in zip(self.offsets, box.offsets, home.offsets, strict=True))
            lengths = box.lengths
        return self.index + tuple(slice(s, s + n) for s, n in zip(starts, lengths, strict=True))


@dataclass(frozen=True, slots=True)
class SGLangParam:
    name: str
    shape: tuple[int, ...]  # local shape on this rank (including vocabulary padding)
    placements: tuple[Placement, ...]


def stacked_rows(name: str, shards: Sequence[TensorShard], trailing: Sequence[int]) -> SGLangParam:
    """A parameter that is its canonical boxes concatenated along dim 0 (qkv_proj, gate_up_proj, the MLA
    fused_qkv_a_proj_with_mqa)."""
    placements, row = [], 0
    for shard in shards:
        if tuple(shard.box.lengths[1:]) != tuple(trailing):
            raise ShardError(f"{name}: {shard.name} box {shard.box} does not match trailing shape {trailing}")
        placements.append(Placement(shard, (row, *(0 for _ in trailing))))
        row += shard.box.lengths[0]
    return SGLangParam(name, (row, *trailing), tuple(placements))


def plain(name: str, shard: TensorShard | None, local_shape: Sequence[int]) -> SGLangParam:
    """A parameter holding one canonical box at its origin (None: a rank that holds only padding)."""
    placements = () if shard is None else (Placement(shard, tuple(0 for _ in local_shape)),)
    return SGLangParam(name, tuple(local_shape), placements)
