"""One side's sharding of a model: for each canonical parameter, which rank holds which box.

A `Layout` is the per-parameter metadata both sides of a transfer exchange before planning: canonical name,
global shape, dtype, and every rank's shard as a `Box`. It is plain data (JSON in, JSON out, never pickle)
and validated on construction, so a malformed description fails here with the parameter's name instead of
surfacing later as a hang.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from colocate_runtime.shards import Box, RankShards, ShardError, TensorShard, dtype_bytes, stable_hash

LAYOUT_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class ParamShards:
    """Every rank's box of one parameter on one side; `shards` is sorted by (rank, offsets)."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    shards: tuple[tuple[int, Box], ...]

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if any(n < 0 for n in self.global_shape):
            raise ShardError(f"{self.name}: negative global shape {self.global_shape}")
        full = Box.full(self.global_shape)
        seen: set[int] = set()
        for rank, box in self.shards:
            if rank < 0:
                raise ShardError(f"{self.name}: negative rank {rank}")
            if rank in seen:
                # One box per (rank, parameter) keeps local tensors addressable by name alone.
                raise ShardError(f"{self.name}: rank {rank} holds more than one shard")
            seen.add(rank)
            if box.ndim != len(self.global_shape):
                raise ShardError(
                    f"{self.name}: rank {rank} box has {box.ndim} dimensions, global shape "
                    f"{self.global_shape} has {len(self.global_shape)}"
                )
            if not full.contains(box):
                raise ShardError(
                    f"{self.name}: rank {rank} box {box} lies outside global shape {self.global_shape}"
                )
        if list(self.shards) != sorted(self.shards, key=lambda s: (s[0], s[1].offsets)):
            raise ShardError(f"{self.name}: shards must be sorted by rank")

    def box_of(self, rank: int) -> Box | None:
        for r, box in self.shards:
            if r == rank:
                return box
        return None

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.shards)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.global_shape),
            "dtype": self.dtype,
            "shards": [[rank, *box.to_json()] for rank, box in self.shards],
        }

    @staticmethod
    def from_json(data: Mapping) -> ParamShards:
        name = str(data.get("name", "<unnamed>"))
        try:
            shards = tuple(
                sorted(((int(r), Box.from_json((o, n))) for r, o, n in data["shards"]), key=_shard_key)
            )
            return ParamShards(name, tuple(int(x) for x in data["shape"]), str(data["dtype"]), shards)
        except ShardError as exc:
            message = str(exc)
            raise ShardError(message if message.startswith(name) else f"{name}: {message}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{name}: malformed shard metadata ({exc!r})") from None


def _shard_key(shard: tuple[int, Box]) -> tuple[int, tuple[int, ...]]:
    return shard[0], shard[1].offsets


@dataclass(frozen=True, slots=True)
class Layout:
    """All parameters of one side (trainer or inference engine), sorted by name."""

    params: tuple[ParamShards, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if names != sorted(names):
            raise ShardError("layout parameters must be sorted by name")
        for a, b in itertools.pairwise(names):
            if a == b:
                raise ShardError(f"{a}: described twice in one layout")

    @staticmethod
    def of(params: Iterable[ParamShards]) -> Layout:
        return Layout(tuple(sorted(params, key=lambda p: p.name)))

    @staticmethod
    def from_ranks(ranks: Iterable[RankShards]) -> Layout:
        """Regroup per-rank shard lists (what each rank knows about itself) into per-parameter metadata."""
        grouped: dict[str, list[tuple[int, TensorShard]]] = {}
        for rank_shards in ranks:
            for shard in rank_shards.shards:
                grouped.setdefault(shard.name, []).append((rank_shards.rank, shard))
        params = []
        for name, held in grouped.items():
            shapes = {s.global_shape for _, s in held}
            dtypes = {s.dtype for _, s in held}
            if len(shapes) > 1:
                raise ShardError(f"{name}: ranks disagree on the global shape: {sorted(shapes)}")
            if len(dtypes) > 1:
                raise ShardError(f"{name}: ranks disagree on the dtype: {sorted(dtypes)}")
            shards = tuple(sorted(((r, s.box) for r, s in held), key=_shard_key))
            params.append(ParamShards(name, shapes.pop(), dtypes.pop(), shards))
        return Layout.of(params)

    def rank_shards(self, rank: int) -> RankShards:
        """What one rank holds, as the shared `RankShards` record."""
        return RankShards.of(
            rank,
            (
                TensorShard(p.name, p.global_shape, p.dtype, box)
                for p in self.params
                for r, box in p.shards
                if r == rank
            ),
        )

    def by_name(self) -> dict[str, ParamShards]:
        return {p.name: p for p in self.params}

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for p in self.params for r in p.ranks}))

    def to_json(self) -> dict:
        return {"schema": LAYOUT_SCHEMA, "params": [p.to_json() for p in self.params]}

    @staticmethod
    def from_json(data: Mapping) -> Layout:
        if data.get("schema") != LAYOUT_SCHEMA:
            raise ShardError(f"layout schema {data.get('schema')!r} is not {LAYOUT_SCHEMA}")
        return Layout.of(ParamShards.from_json(p) for p in data["params"])

    def hash(self) -> str:
        return stable_hash(self.to_json())


def split_extent(length: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of each of `parts` near-equal pieces; the first `length % parts` are one longer,
    as Megatron and SGLang split uneven dimensions."""
    if parts < 1:
        raise ShardError(f"cannot split into {parts} parts")
    base, extra = divmod(length, parts)
    pieces, offset = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        pieces.append((offset, n))
        offset += n
    return pieces


def split_box(shape: Sequence[int], dim: int, parts: int, index: int) -> Box:
    """The `index`-th of `parts` slabs of a tensor of `shape` along `dim` (tensor-parallel style)."""
    offset, length = split_extent(shape[dim], parts)[index]
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = offset, length
    return Box(tuple(offsets), tuple(lengths))
