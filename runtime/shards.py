"""Shard metadata shared by converters, transfer plans and the colocated path.

A parameter is known by its canonical name, global shape and dtype; each rank holds one box of it (an offset
and a length per dimension). Everything here is plain data: hashable, comparable and serialisable to JSON,
never pickled, so ranks can exchange it through torch.distributed or Redis and compare it by hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# dtype names as torch spells them after "torch."; kept as strings so planning needs no torch import.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class ShardError(ValueError):
    """Metadata that cannot describe a valid shard (the message names the parameter)."""


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ShardError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle of a tensor: per dimension an offset and a length."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ShardError(f"box has {len(self.offsets)} offsets but {len(self.lengths)} lengths")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise ShardError(f"box {self} has a negative offset or length")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they do not overlap."""
        if self.ndim != other.ndim:
            raise ShardError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def relative_to(self, outer: Box) -> Box:
        """This box in the local coordinates of `outer` (which must contain it)."""
        if not outer.contains(self):
            raise ShardError(f"box {self} is not inside {outer}")
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        """The index expression of this box (a tensor indexed with it is the box's view)."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))

    def difference(self, other: Box) -> tuple[Box, ...]:
        """What of this box lies outside `other`: disjoint, non-empty boxes, at most two per dimension.

        One dimension at a time, the slabs before and after the common part are cut off and the rest narrowed
        to it, so the pieces never overlap and together with the common part tile this box."""
        common = self.intersect(other)
        if common is None:
            return (self,) if self.numel else ()
        pieces: list[Box] = []
        offsets, lengths = list(self.offsets), list(self.lengths)
        for d, (lo, hi) in enumerate(zip(common.offsets, common.ends, strict=True)):
            start, end = offsets[d], offsets[d] + lengths[d]
            if lo > start:
                pieces.append(Box(tuple(offsets), (*lengths[:d], lo - start, *lengths[d + 1 :])))
            if hi < end:
                pieces.append(
                    Box((*offsets[:d], hi, *offsets[d + 1 :]), (*lengths[:d], end - hi, *lengths[d + 1 :]))
                )
            offsets[d], lengths[d] = lo, hi - lo
        return tuple(pieces)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + m <= a + n
            for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True)
        )

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]

    @staticmethod
    def from_json(data: Sequence[Sequence[int]]) -> Box:
        offsets, lengths = data
        return Box(tuple(int(x) for x in offsets), tuple(int(x) for x in lengths))


@dataclass(frozen=True, slots=True)
class TensorShard:
    """One rank's piece of one canonical parameter."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    box: Box

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if self.box.ndim != len(self.global_shape):
            raise ShardError(
                f"{self.name}: box has {self.box.ndim} dimensions, global shape {self.global_shape} has "
                f"{len(self.global_shape)}"
            )
        if not Box.full(self.global_shape).contains(self.box):
            raise ShardError(f"{self.name}: box {self.box} lies outside global shape {self.global_shape}")

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtype_bytes(self.dtype)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.global_shape),
            "dtype": self.dtype,
            "box": self.box.to_json(),
        }

    @staticmethod
    def from_json(data: dict) -> TensorShard:
        return TensorShard(
            name=str(data["name"]),
            global_shape=tuple(int(x) for x in data["shape"]),
            dtype=str(data["dtype"]),
            box=Box.from_json(data["box"]),
        )


@dataclass(frozen=True, slots=True)
class RankShards:
    """Everything one rank holds, in a fixed order (sorted by name, then box)."""

    rank: int
    shards: tuple[TensorShard, ...]

    @staticmethod
    def of(rank: int, shards: Iterable[TensorShard]) -> RankShards:
        return RankShards(rank, tuple(sorted(shards, key=lambda s: (s.name, s.box.offsets))))

    def to_json(self) -> dict:
        return {"rank": self.rank, "shards": [s.to_json() for s in self.shards]}

    @staticmethod
    def from_json(data: dict) -> RankShards:
        return RankShards(int(data["rank"]), tuple(TensorShard.from_json(s) for s in data["shards"]))


def stable_hash(obj: object) -> str:
    """A hash that is equal on every rank for equal JSON-able data (for comparing plans and metadata)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
