"""Cutting a plan into chunk rounds that respect a staging budget, and each rank's view of them.

The budget bounds, for every rank and every chunk, the bytes it sends plus the bytes it receives, summed over
all peers and counted in the receiver's dtype (what travels on the wire). Transfers bigger than the budget are
split into slabs first. The assignment is a pure function of the plan and the budget, so every rank derives
the same chunks and the same packed-buffer offsets for each (sender, receiver) pair without exchanging them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from colocate_runtime.p2p.layout import Layout
from colocate_runtime.p2p.peers import meeting_round
from colocate_runtime.p2p.plan import PlanError, Transfer, TransferPlan
from colocate_runtime.shards import Box, dtype_bytes, stable_hash

# Every slice starts at a multiple of this in a packed buffer: enough for any dtype view and for vectorised
# copies. Slice sizes are rounded up to it when budgeting, so buffers never outgrow the budget.
ALIGN = 16


# Slices this big travel as their own message: packing them costs two copies that contend with the wire
# for memory bandwidth (on H200 a concurrent 16 GB copy slowed a flat NVLink send by ~20%). Measured on the
# 16 GB llama8b move: packing the 8 MiB k/v projections (a 16 MiB threshold) took 46.9 ms, sending them as
# messages of their own 45.5 ms. Smaller slices are packed, so thousands of tiny ops never reach NCCL
# (a 1 MiB message alone costs ~25 us of wire time).
DIRECT_MIN_BYTES = 4 << 20


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def is_dense_in(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether `box` of a row-major dense tensor of `shape` is itself one dense run of memory."""
    d = len(shape) - 1
    while d >= 0 and box.offsets[d] == 0 and box.lengths[d] == shape[d]:
        d -= 1
    return all(box.lengths[i] == 1 for i in range(d))


def split_transfer(transfer: Transfer, capacity: int) -> list[Transfer]:
    """Pieces of `transfer` whose wire bytes (rounded up to ALIGN) fit `capacity`, as slabs along the
    outermost dimension that allows it, so each piece of a row-major tensor stays as contiguous as it can."""
    if aligned(transfer.wire_bytes) <= capacity:
        return [transfer]
    elem = dtype_bytes(transfer.dst_dtype)
    if aligned(elem) > capacity:
        raise PlanError(f"{transfer.name}: a chunk budget of {capacity} B cannot hold one {ALIGN}-byte slot")
    lengths = transfer.region.lengths
    # inner[d]: bytes of one index step along dimension d (everything after d taken whole).
    inner = [elem] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        inner[d] = inner[d + 1] * lengths[d + 1]
    dim = next(d for d in range(len(lengths)) if aligned(inner[d]) <= capacity)
    step = max(1, capacity // inner[dim])
    while step > 1 and aligned(step * inner[dim]) > capacity:
        step -= 1
    pieces: list[Transfer] = []
    origin = transfer.region.offsets

    def walk(prefix: tuple[int, ...]) -> None:
        d = len(prefix)
        if d == dim:
            for start in range(0, lengths[dim], step):
                n = min(step, lengths[dim] - start)
                offsets = (*prefix, origin[dim] + start, *origin[dim + 1 :])
                sizes = (*(1,) * dim, n, *lengths[dim + 1 :])
                pieces.append(transfer.restrict(Box(offsets, sizes)))
            return
        for i in range(lengths[d]):
            walk((*prefix, origin[d] + i))

    walk(())
    return pieces


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The plan's remote transfers cut into pieces and grouped into chunk rounds; local copies kept apart."""

    capacity: int
    chunks: tuple[tuple[Transfer, ...], ...]
    local: tuple[Transfer, ...]

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def usage(self, chunk: int) -> dict[int, int]:
        """Budgeted bytes (sent + received, ALIGN-rounded) per rank in one chunk."""
        used: dict[int, int] = {}
        for t in self.chunks[chunk]:
            b = aligned(t.wire_bytes)
            used[t.src] = used.get(t.src, 0) + b
            used[t.dst] = used.get(t.dst, 0) + b
        return used

    def hash(self) -> str:
        return stable_hash(
            {"capacity": self.capacity, "chunks": [[t.to_json() for t in c] for c in self.chunks]}
        )


def assign_chunks(plan: TransferPlan, capacity: int) -> ChunkPlan:
    """First-fit of the pieces into chunks, taking the pairs in turn (piece k of every pair before piece
    k + 1 of any) so that each chunk mixes all peers and no pair's traffic piles up at the end."""
    capacity = capacity // ALIGN * ALIGN
    if capacity < ALIGN:
        raise PlanError(f"chunk budget {capacity} B is below the {ALIGN}-byte minimum")
    per_pair: dict[tuple[int, int], list[Transfer]] = {}
    local: list[Transfer] = []
    for t in plan.transfers:
        if t.is_local:
            local.append(t)
        else:
            per_pair.setdefault((t.src, t.dst), []).extend(split_transfer(t, capacity))
    lists = [per_pair[k] for k in sorted(per_pair)]
    used: list[dict[int, int]] = []
    chunks: list[list[Transfer]] = []
    first_open: dict[int, int] = {}  # per rank: chunks before it have no ALIGN-sized room left

    def room(c: int, rank: int) -> int:
        return capacity - used[c].get(rank, 0)

    depth = max((len(x) for x in lists), default=0)
    for k in range(depth):
        for pieces in lists:
            if k >= len(pieces):
                continue
            piece = pieces[k]
            b = aligned(piece.wire_bytes)
            c = max(first_open.get(piece.src, 0), first_open.get(piece.dst, 0))
            while c < len(chunks) and (room(c, piece.src) < b or room(c, piece.dst) < b):
                c += 1
            if c == len(chunks):
                chunks.append([])
                used.append({})
            chunks[c].append(piece)
            for rank in (piece.src, piece.dst):
                used[c][rank] = used[c].get(rank, 0) + b
                c_open = first_open.get(rank, 0)
                while c_open < len(chunks) and room(c_open, rank) < ALIGN:
                    c_open += 1
                first_open[rank] = c_open
    return ChunkPlan(
        capacity,
        tuple(tuple(sorted(c, key=Transfer.sort_key)) for c in chunks),
        tuple(local),
    )


@dataclass(frozen=True, slots=True)
class Slice:
    """A piece placed in a packed per-peer buffer at a byte offset."""

    transfer: Transfer
    offset: int


@dataclass(frozen=True, slots=True)
class Message:
    """One wire message (one isend / irecv): slices laid out back to back at ALIGN-aligned offsets."""

    slices: tuple[Slice, ...]

    @property
    def nbytes(self) -> int:
        last = self.slices[-1]
        return last.offset + last.transfer.wire_bytes


@dataclass(frozen=True, slots=True)
class PeerBatch:
    """What one rank exchanges with one peer in one chunk: one `batch_isend_irecv`. Per direction the small
    slices travel packed in one message, then each large slice in its own message, which either end may
    move in place (no copy) when its tensor allows; both ends post the messages in this order."""

    peer: int
    round: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]

    @property
    def send_bytes(self) -> int:
        return sum(m.nbytes for m in self.sends)

    @property
    def recv_bytes(self) -> int:
        return sum(m.nbytes for m in self.recvs)


def _messages(pieces: list[Transfer], direct_min_bytes: int) -> tuple[Message, ...]:
    small = [t for t in pieces if t.wire_bytes < direct_min_bytes]
    large = [t for t in pieces if t.wire_bytes >= direct_min_bytes]
    out = []
    if small:
        slices, offset = [], 0
        for t in small:
            slices.append(Slice(t, offset))
            offset += aligned(t.wire_bytes)
        out.append(Message(tuple(slices)))
    out.extend(Message((Slice(t, 0),)) for t in large)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RankChunk:
    index: int
    batches: tuple[PeerBatch, ...]  # in round order

    @property
    def staging_bound(self) -> int:
        """Bytes of staging this chunk can need if no message moves in place."""
        return sum(aligned(m.nbytes) for b in self.batches for m in b.sends + b.recvs)


@dataclass(frozen=True, slots=True)
class RankSchedule:
    """One rank's share of a `ChunkPlan`: its local copies and, per chunk, its peer batches by round."""

    rank: int
    world: int
    capacity: int
    local: tuple[Transfer, ...]
    chunks: tuple[RankChunk, ...]


def rank_schedule(
    chunk_plan: ChunkPlan, rank: int, world: int, direct_min_bytes: int = DIRECT_MIN_BYTES
) -> RankSchedule:
    """This rank's batches; slices of at least `direct_min_bytes` get a message of their own."""
    chunks = []
    for index, pieces in enumerate(chunk_plan.chunks):
        sends: dict[int, list[Transfer]] = {}
        recvs: dict[int, list[Transfer]] = {}
        for t in pieces:
            if t.src >= world or t.dst >= world:
                raise PlanError(f"{t.name}: the plan names rank {max(t.src, t.dst)} in a world of {world}")
            if t.src == rank:
                sends.setdefault(t.dst, []).append(t)
            elif t.dst == rank:
                recvs.setdefault(t.src, []).append(t)
        batches = [
            PeerBatch(
                peer,
                meeting_round(rank, peer, world),
                _messages(sends.get(peer, []), direct_min_bytes),
                _messages(recvs.get(peer, []), direct_min_bytes),
            )
            for peer in set(sends) | set(recvs)
        ]
        batches.sort(key=lambda b: b.round)
        chunks.append(RankChunk(index, tuple(batches)))
    local = tuple(t for t in chunk_plan.local if t.dst == rank)
    return RankSchedule(rank, world, chunk_plan.capacity, local, tuple(chunks))


def shard_shapes(senders: Layout, receivers: Layout) -> dict[tuple[str, int, bool], tuple[int, ...]]:
    """Every rank's shard shape per parameter and side (True: sending), for `staged_peak`."""
    return {
        (p.name, rank, sending): box.lengths
        for layout, sending in ((senders, True), (receivers, False))
        for p in layout.params
        for rank, box in p.shards
    }


def staged_peak(
    chunk_plan: ChunkPlan,
    shards: Mapping[tuple[str, int, bool], tuple[int, ...]],
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> int:
    """The most staging any rank needs for one chunk if its tensors are dense: packed messages on both
    ends, and own messages whose slice is not one dense run at that end (or, sending, needs a cast).
    `shards[(name, rank, sending)]` is that rank's shard shape. Pure metadata, so every rank gets the same."""
    peak = 0
    for pieces in chunk_plan.chunks:
        used: dict[int, int] = {}
        for t in pieces:
            b = aligned(t.wire_bytes)
            small = t.wire_bytes < direct_min_bytes
            if (
                small
                or t.src_dtype != t.dst_dtype
                or not is_dense_in(t.src_box, shards[(t.name, t.src, True)])
            ):
                used[t.src] = used.get(t.src, 0) + b
            if small or not is_dense_in(t.dst_box, shards[(t.name, t.dst, False)]):
                used[t.dst] = used.get(t.dst, 0) + b
        peak = max(peak, *used.values(), 0)
    return peak


def plan_chunks(
    plan: TransferPlan,
    budget: int,
    depth: int,
    shards: Mapping[tuple[str, int, bool], tuple[int, ...]],
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> ChunkPlan:
    """Chunks of the whole budget when the plan moves (almost) everything in place, else of budget / depth.

    The budget bounds the staging a rank holds. With `depth` chunks in flight each needs its own staging, so
    a plan that stages much gets chunks of budget / depth. One that stages at most budget / depth per chunk
    can take whole-budget chunks and still pipeline `depth` deep within the budget: half the chunk rounds,
    and each round costs the wire a kernel boundary (~15 us on H200 NVLink)."""
    whole = assign_chunks(plan, budget)
    if depth > 1 and staged_peak(whole, shards, direct_min_bytes) * depth <= budget:
        return whole
    return assign_chunks(plan, budget // depth)
