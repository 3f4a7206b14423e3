"""The transfer plan: which rank sends which region of which parameter to whom.

Pure and deterministic: every rank computes the same `TransferPlan` from the same two layouts, and ranks
compare it by hash before moving a byte. Each non-empty intersection of a receiver shard with a sender shard
is one `Transfer`. Replicated sender shards (data-parallel copies, replicated norms) are resolved here: a
receiver that holds a replica itself copies locally, otherwise the least-loaded holder sends, so replicas
share the work evenly and the choice does not depend on the world size being a power of two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from colocate_runtime.p2p.layout import Layout, ParamShards
from colocate_runtime.shards import Box, ShardError, dtype_bytes, stable_hash

PLAN_SCHEMA = 1

# Casts the sender may apply for the receiver (wire-size parity); anything else is a metadata error.
_FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})

# The first-gap search in error messages walks a grid of cells; beyond this it only reports the count.
_GAP_SEARCH_CELLS = 100_000


class PlanError(ShardError):
    """The two layouts cannot be reconciled (the message names the parameter)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One region of one parameter, from the sender's shard to the receiver's shard.

    `region` is in global coordinates; the origins are the global offsets of the two local shards, so the
    local slices are `region` shifted by them. When `src == dst` the copy is local.
    """

    name: str
    src: int
    dst: int
    region: Box
    src_origin: tuple[int, ...]
    dst_origin: tuple[int, ...]
    src_dtype: str
    dst_dtype: str

    @property
    def src_box(self) -> Box:
        return _shift(self.region, self.src_origin)

    @property
    def dst_box(self) -> Box:
        return _shift(self.region, self.dst_origin)

    @property
    def numel(self) -> int:
        return self.region.numel

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: the sender casts to the receiver's dtype first."""
        return self.region.numel * dtype_bytes(self.dst_dtype)

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    def restrict(self, region: Box) -> Transfer:
        """The same transfer limited to a sub-region (a piece of a transfer split to fit a chunk)."""
        if not self.region.contains(region):
            raise PlanError(f"{self.name}: piece {region} lies outside transfer region {self.region}")
        return Transfer(
            self.name,
            self.src,
            self.dst,
            region,
            self.src_origin,
            self.dst_origin,
            self.src_dtype,
            self.dst_dtype,
        )

    def sort_key(self) -> tuple:
        return (self.src, self.dst, self.name, self.region.offsets, self.region.lengths)

    def to_json(self) -> list:
        return [
            self.name,
            self.src,
            self.dst,
            list(self.region.offsets),
            list(self.region.lengths),
            list(self.src_origin),
            list(self.dst_origin),
            self.src_dtype,
            self.dst_dtype,
        ]

    @staticmethod
    def from_json(data: Sequence) -> Transfer:
        name, src, dst, offsets, lengths, src_origin, dst_origin, src_dtype, dst_dtype = data
        return Transfer(
            str(name),
            int(src),
            int(dst),
            Box(tuple(offsets), tuple(lengths)),
            tuple(src_origin),
            tuple(dst_origin),
            str(src_dtype),
            str(dst_dtype),
        )


def _shift(box: Box, origin: tuple[int, ...]) -> Box:
    return Box(tuple(o - g for o, g in zip(box.offsets, origin, strict=True)), box.lengths)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Every transfer of one reshard, sorted by (src, dst, name, region): the order in which the two ends
    of each (src, dst) pair enumerate their slices, so they agree on buffer layouts without talking."""

    transfers: tuple[Transfer, ...]
    min_world_size: int

    def to_json(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "min_world_size": self.min_world_size,
            "transfers": [t.to_json() for t in self.transfers],
        }

    @staticmethod
    def from_json(data: Mapping) -> TransferPlan:
        if data.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"plan schema {data.get('schema')!r} is not {PLAN_SCHEMA}")
        return TransferPlan(
            tuple(Transfer.from_json(t) for t in data["transfers"]), int(data["min_world_size"])
        )

    def hash(self) -> str:
        return stable_hash(self.to_json())

    def sent_bytes(self) -> dict[int, int]:
        """Wire bytes each rank sends to other ranks (local copies excluded)."""
        out: dict[int, int] = {}
        for t in self.transfers:
            if not t.is_local:
                out[t.src] = out.get(t.src, 0) + t.wire_bytes
        return out

    def received_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.transfers:
            if not t.is_local:
                out[t.dst] = out.get(t.dst, 0) + t.wire_bytes
        return out

    def describe(self) -> str:
        """A short human summary (for logs): transfer counts and bytes per rank."""
        sent, received = self.sent_bytes(), self.received_bytes()
        local = sum(t.wire_bytes for t in self.transfers if t.is_local)
        lines = [f"plan {self.hash()}: {len(self.transfers)} transfers, {local} bytes copied locally"]
        for rank in sorted(set(sent) | set(received)):
            lines.append(f"  rank {rank}: sends {sent.get(rank, 0)} B, receives {received.get(rank, 0)} B")
        return "\n".join(lines)


def build_plan(senders: Layout, receivers: Layout) -> TransferPlan:
    """The plan that fills every receiver shard from the sender shards, each element exactly once.

    Raises `PlanError` naming the parameter when a receiver parameter has no sender, the global shapes differ,
    the dtypes cannot be cast, sender or receiver shards overlap without being identical replicas, or part of
    a receiver shard is held by no sender.
    """
    sender_params = senders.by_name()
    all_ranks = set(senders.ranks) | set(receivers.ranks)
    modulus = max(all_ranks, default=0) + 1
    load: dict[int, int] = {}
    transfers: list[Transfer] = []
    for recv in receivers.params:
        send = sender_params.get(recv.name)
        if send is None:
            raise PlanError(f"{recv.name}: the receivers need it but no sender holds it")
        _check_compatible(send, recv)
        pieces = _distinct_boxes(send, "sender")
        # Receivers either hold the same box (replicas) or disjoint ones: a partial overlap is a description
        # error (two engines' ranks claiming part of each other's shard), never a layout to fill.
        _distinct_boxes(recv, "receiver")
        for rank, box in recv.shards:
            if box.numel == 0:
                continue
            covered = 0
            for piece, holders in pieces:
                region = piece.intersect(box)
                if region is None:
                    continue
                covered += region.numel
                src = _choose_holder(holders, rank, load, modulus)
                if src != rank:
                    load[src] = load.get(src, 0) + region.numel * dtype_bytes(recv.dtype)
                transfers.append(
                    Transfer(recv.name, src, rank, region, piece.offsets, box.offsets, send.dtype, recv.dtype)
                )
            # Pieces are pairwise disjoint, so their intersections with `box` are too: equal volume means
            # the box is covered exactly once.
            if covered != box.numel:
                raise PlanError(_gap_message(recv.name, rank, box, [p for p, _ in pieces], covered))
    transfers.sort(key=Transfer.sort_key)
    return TransferPlan(tuple(transfers), modulus)


def _check_compatible(send: ParamShards, recv: ParamShards) -> None:
    if send.global_shape != recv.global_shape:
        raise PlanError(
            f"{recv.name}: shape mismatch: senders describe global shape {send.global_shape}, receivers "
            f"{recv.global_shape}"
        )
    if send.dtype != recv.dtype and not (send.dtype in _FLOAT_DTYPES and recv.dtype in _FLOAT_DTYPES):
        raise PlanError(
            f"{recv.name}: dtype mismatch: senders hold {send.dtype}, receivers expect {recv.dtype}, "
            f"and only casts between {sorted(_FLOAT_DTYPES)} are done on the wire"
        )


def _distinct_boxes(param: ParamShards, side: str) -> list[tuple[Box, tuple[int, ...]]]:
    """Distinct non-empty boxes of one side with the ranks holding each (replicas); rejects partial
    overlaps."""
    holders: dict[Box, list[int]] = {}
    for rank, box in param.shards:
        if box.numel:
            holders.setdefault(box, []).append(rank)
    pieces = sorted(
        ((box, tuple(sorted(ranks))) for box, ranks in holders.items()), key=lambda p: p[0].offsets
    )
    if len(pieces) < 2:
        return pieces
    # Sweep along the dimension with the most distinct starts: only boxes still open there can overlap.
    ndim = len(param.global_shape)
    dim = max(range(ndim), key=lambda d: len({p[0].offsets[d] for p in pieces}))
    active: list[tuple[Box, tuple[int, ...]]] = []
    for box, ranks in sorted(pieces, key=lambda p: (p[0].offsets[dim], p[0].offsets)):
        active = [a for a in active if a[0].ends[dim] > box.offsets[dim]]
        for other, other_ranks in active:
            if other.intersect(box) is not None:
                raise PlanError(
                    f"{param.name}: overlap: {side} box {other.to_json()} (ranks {list(other_ranks)}) and "
                    f"{box.to_json()} (ranks {list(ranks)}) overlap without being identical replicas"
                )
        active.append((box, ranks))
    return pieces


def _choose_holder(holders: tuple[int, ...], dst: int, load: dict[int, int], modulus: int) -> int:
    """A receiver holding a replica copies locally; otherwise the least-loaded holder sends, ties broken
    by distance from the receiver on the rank ring so equal replicas spread over receivers."""
    if dst in holders:
        return dst
    return min(holders, key=lambda h: (load.get(h, 0), (h - dst) % modulus, h))


def _gap_message(name: str, rank: int, box: Box, pieces: list[Box], covered: int) -> str:
    base = (
        f"{name}: gap: receiver rank {rank} box {box.to_json()} is not covered by the senders "
        f"({box.numel - covered} of {box.numel} elements have no source)"
    )
    point = _first_gap(box, pieces)
    return base + (f"; first uncovered element at {list(point)}" if point is not None else "")


def _first_gap(box: Box, pieces: list[Box]) -> tuple[int, ...] | None:
    clipped = [c for c in (p.intersect(box) for p in pieces) if c is not None]
    cuts = []
    for d in range(box.ndim):
        marks = {box.offsets[d], box.ends[d]}
        for c in clipped:
            marks.update((c.offsets[d], c.ends[d]))
        cuts.append(sorted(marks)[:-1])
    cells = 1
    for c in cuts:
        cells *= len(c)
    if cells > _GAP_SEARCH_CELLS:
        return None

    def first(prefix: tuple[int, ...]) -> tuple[int, ...] | None:
        if len(prefix) == box.ndim:
            unit = Box(prefix, (1,) * box.ndim)
            return None if any(c.contains(unit) for c in clipped) else prefix
        for start in cuts[len(prefix)]:
            found = first((*prefix, start))
            if found is not None:
                return found
        return None

    return first(())


# --- ranks that planned differently: which parameter ----------------------------------------------------

_PARTS = ("sender shards", "receiver shards", "transfers")
_ABSENT = "-"


def fingerprint(senders: Layout, receivers: Layout, plan: TransferPlan) -> dict[str, list[str]]:
    """Per parameter (every name either side describes): short digests of its sender shards, its receiver
    shards and its transfers. Ranks whose plan hashes differ exchange these to find what differs
    (`first_difference`); plain JSON-able data."""
    transfers: dict[str, list] = {}
    for t in plan.transfers:
        transfers.setdefault(t.name, []).append(t.to_json())
    send, recv = senders.by_name(), receivers.by_name()

    def digest(p: ParamShards | None) -> str:
        return _ABSENT if p is None else stable_hash(p.to_json())[:12]

    return {
        name: [digest(send.get(name)), digest(recv.get(name)), stable_hash(transfers.get(name, []))[:12]]
        for name in sorted(set(send) | set(recv))
    }


@dataclass(frozen=True, slots=True)
class PlanDifference:
    name: str | None  # the first parameter that differs; None when every fingerprint agrees
    part: str  # one of "sender shards", "receiver shards", "transfers" ("" when name is None)
    text: str  # for the error message: what differs and which ranks hold what


def first_difference(tables: Sequence[Mapping[str, Sequence[str]]]) -> PlanDifference:
    """The first parameter (by name) whose sender shards, receiver shards or transfers differ between the
    ranks' `fingerprint`s (index = rank), with the ranks grouped by what they hold."""
    names = sorted(set().union(*(set(t) for t in tables)))
    for name in names:
        for i, part in enumerate(_PARTS):
            groups: dict[str, list[int]] = {}
            for rank, table in enumerate(tables):
                entry = table.get(name)
                groups.setdefault(_ABSENT if entry is None else str(entry[i]), []).append(rank)
            if len(groups) > 1:
                who = "; ".join(
                    f"ranks {ranks} " + ("do not describe it" if key == _ABSENT else f"have {key}")
                    for key, ranks in sorted(groups.items(), key=lambda kv: kv[1])
                )
                return PlanDifference(name, part, f"{name}: its {part} differ between ranks ({who})")
    return PlanDifference(
        None, "", "every parameter's shards and transfers agree between the ranks: they run different code"
    )


def describe_shards(p: ParamShards | None, limit: int = 240) -> str:
    """One side's boxes of a parameter as `rank:offsets+lengths`, cut to `limit` characters (for errors)."""
    if p is None:
        return "not described"
    text = ", ".join(f"{r}:{list(b.offsets)}+{list(b.lengths)}" for r, b in p.shards)
    return text if len(text) <= limit else text[: limit - 3] + "..."
