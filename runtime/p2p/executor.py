"""Runs a plan over torch.distributed: chunked, packed per peer, peers met in the circle order.

One process group, one rank per device. A rank may send, receive or both (colocated trainer and inference
shards on the same GPU), so disjoint sender and receiver sets are just the special case where some ranks hold
nothing on one side. Per chunk and per peer the slices travel in one contiguous byte buffer, cast to the
receiver's dtype by the sender (byte counts always match). Every rank walks every chunk and every round in
the same order, empty ones included, so no rank leaves while a peer still waits.

Everything that can fail locally (plan, tensor shapes, dtypes) is checked before the first byte moves, and
the outcome is agreed with one all-reduce, so a bad rank makes every rank raise instead of leaving its peers
waiting. Waits poll with a deadline: a stuck peer becomes a `PeerTimeoutError` naming it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from colocate_runtime.p2p.chunks import (
    ChunkPlan,
    Message,
    PeerBatch,
    RankSchedule,
    aligned,
    assign_chunks,
    rank_schedule,
)
from colocate_runtime.p2p.config import ExecutorConfig
from colocate_runtime.p2p.errors import P2PError, PeerTimeoutError, PlanMismatchError
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.p2p.plan import Plan, PlanError, Transfer, build_plan
from colocate_runtime.p2p.staging import Arena, as_bytes, box_view, torch_dtype, typed_view
from colocate_runtime.shards import ShardError

log = logging.getLogger("colocate_runtime.p2p")

# Poll interval bounds while waiting for a batch: short enough not to idle the link between chunks.
_POLL_SPINS = 20_000
_POLL_SLEEP_S = 1e-3
# Chunks the host may post before confirming older ones, and the queued launches (copies and messages)
# behind unconfirmed chunks beyond which it waits: a stuck peer must show as a timeout, not as the host
# blocking in a full CUDA launch queue.
_RUN_AHEAD_CHUNKS = 4
_MAX_QUEUED_LAUNCHES = 512
# Bytes exchanged with each peer when the exchange is created, to open the NCCL connection up front.
_CONNECT_BYTES = 1 << 20
_TAGS_PER_CHUNK = 1 << 12
_TAG_LIMIT = (1 << 31) - 1
_GONE = "a rank is dead, stuck or on a different schedule; the process group is no longer usable"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    chunk: int
    round: int
    peer: int
    event: str  # "enqueued" or "drained"
    send_bytes: int
    recv_bytes: int
    seconds: float  # since the run started


@dataclass(frozen=True, slots=True)
class RunReport:
    rank: int
    n_chunks: int
    batches: int
    bytes_sent: int  # payload to other ranks, in the receivers' dtypes (alignment padding not counted)
    bytes_received: int
    bytes_local: int  # copied between this rank's own source and target shards
    staging_bytes: int  # the arena: the most staging this rank held at any time
    seconds: float
    trace: tuple[TraceEvent, ...] = ()


@dataclass(slots=True)
class _Op:
    """One wire message bound to local tensors: moved in place (`direct`: a byte view of the local tensor)
    or through staging that its slices are packed into (sender) or unpacked from (receiver)."""

    nbytes: int
    items: list[tuple[torch.Tensor, int, torch.dtype, tuple[int, ...]]]
    direct: torch.Tensor | None = None
    staging: torch.Tensor | None = None  # the arena window while the message is in flight


@dataclass(slots=True)
class _BoundBatch:
    batch: PeerBatch
    sends: list[_Op]
    recvs: list[_Op]


@dataclass(slots=True)
class _BoundChunk:
    index: int
    batches: list[_BoundBatch]

    @property
    def staging(self) -> int:
        return sum(aligned(op.nbytes) for b in self.batches for op in b.sends + b.recvs if op.direct is None)


@dataclass(slots=True)
class _Posted:
    bound: _BoundBatch
    works: list


class P2PExchange:
    """A reshard between two layouts over one process group, set up once and run every weight sync."""

    def __init__(
        self,
        *,
        senders: Layout,
        receivers: Layout,
        plan: Plan,
        chunk_plan: ChunkPlan,
        schedule: RankSchedule,
        group: dist.ProcessGroup | None,
        device: torch.device,
        config: ExecutorConfig,
    ) -> None:
        self.senders = senders
        self.receivers = receivers
        self.plan = plan
        self.chunk_plan = chunk_plan
        self.schedule = schedule
        self.group = group
        self.device = device
        self.config = config
        self.rank = schedule.rank
        self.world = schedule.world
        self._shards = {"source": senders.by_name(), "target": receivers.by_name()}
        self._polls = dist.get_backend(group) == "nccl"

    @classmethod
    def create(
        cls,
        senders: Layout,
        receivers: Layout,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        config: ExecutorConfig | None = None,
    ) -> P2PExchange:
        """Collective: every rank of `group` calls it with the same layouts. Builds the plan, checks that all
        ranks built the same one (by hash) and agrees on the chunk budget (the smallest configured)."""
        config = config or ExecutorConfig()
        device = device or default_device(group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        error: Exception | None = None
        digest = 0
        try:
            plan = build_plan(senders, receivers)
            if plan.min_world_size > world:
                raise PlanError(
                    f"the layouts name rank {plan.min_world_size - 1} but the group has {world} ranks"
                )
            digest = int(plan.hash()[:15], 16)  # 60 bits: fits a non-negative int64
        except ShardError as exc:
            error = exc
        # One MAX all-reduce: failure flags and digests in per-rank slots, and -capacity for a MIN.
        votes = torch.zeros(2 * world + 2, dtype=torch.int64, device=device)
        votes[rank] = int(error is not None)
        votes[world + rank] = digest
        votes[2 * world] = -config.chunk_capacity
        votes[2 * world + 1] = -config.direct_min_bytes
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        values = votes.tolist()
        flags, digests = values[:world], values[world : 2 * world]
        capacity, direct_min = -values[2 * world], -values[2 * world + 1]
        if error is not None:
            raise error
        failed = [r for r, f in enumerate(flags) if f]
        if failed:
            raise P2PError(f"rank {rank}: the plan could not be built on rank(s) {failed}; nothing was sent")
        if len(set(digests)) > 1:
            by_digest: dict[int, list[int]] = {}
            for r, d in enumerate(digests):
                by_digest.setdefault(d, []).append(r)
            groups = "; ".join(f"{d:015x}: ranks {rs}" for d, rs in sorted(by_digest.items()))
            raise PlanMismatchError(f"rank {rank}: ranks built different plans ({groups}); nothing was sent")
        chunk_plan = assign_chunks(plan, capacity)
        schedule = rank_schedule(chunk_plan, rank, world, direct_min)
        exchange = cls(
            senders=senders,
            receivers=receivers,
            plan=plan,
            chunk_plan=chunk_plan,
            schedule=schedule,
            group=group,
            device=device,
            config=config,
        )
        exchange._connect()
        return exchange

    def run(self, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> RunReport:
        """Collective: move this rank's `sources` (its sender shards, by name) into every receiver's `targets`
        (its receiver shards, by name). Tensors must have their shard's shape, dtype and this exchange's
        device; they may be non-contiguous views. Returns after the data is in place."""
        start = time.perf_counter()
        with torch.no_grad():
            error: Exception | None = None
            try:
                local, chunks = self._bind(sources, targets)
            except (ShardError, P2PError) as exc:
                error, local, chunks = exc, [], []
            n_chunks = self._preflight(failed=error is not None, n_chunks=len(chunks))
            if error is not None:
                raise error
            chunks += [_BoundChunk(i, []) for i in range(len(chunks), n_chunks)]
            for dst_view, src_view in local:
                dst_view.copy_(src_view)
            depth = self.config.pipeline_depth
            slots = [max((c.staging for c in chunks[s::depth]), default=0) for s in range(depth)]
            arena = Arena(slots, self.device)
            trace: list[TraceEvent] = []
            try:
                self._exchange(chunks, arena, trace, start)
            finally:
                arena.release()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return RunReport(
            rank=self.rank,
            n_chunks=n_chunks,
            batches=sum(len(c.batches) for c in chunks),
            bytes_sent=_payload(self.schedule, sending=True),
            bytes_received=_payload(self.schedule, sending=False),
            bytes_local=sum(t.wire_bytes for t in self.schedule.local),
            staging_bytes=arena.nbytes,
            seconds=time.perf_counter() - start,
            trace=tuple(trace),
        )

    def abort(self) -> None:
        """Tear the communicator down after a timeout so stuck NCCL kernels cannot outlive the error."""
        if dist.get_backend(self.group) == "nccl":
            dist.distributed_c10d._abort_process_group(self.group)

    # -- binding: local checks, before anything is sent --------------------------------------------------

    def _bind(
        self, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[_BoundChunk]]:
        checked: set[tuple[str, str]] = set()

        def source(t: Transfer) -> torch.Tensor:
            return self._local_tensor("source", sources, t.name, t.src_dtype, checked)

        def target(t: Transfer) -> torch.Tensor:
            return self._local_tensor("target", targets, t.name, t.dst_dtype, checked)

        local = [
            (box_view(target(t), t.dst_box), box_view(source(t), t.src_box)) for t in self.schedule.local
        ]

        def bind(message: Message, sending: bool) -> _Op:
            items = []
            for piece in message.slices:
                t = piece.transfer
                view = box_view(source(t), t.src_box) if sending else box_view(target(t), t.dst_box)
                items.append((view, piece.offset, torch_dtype(t.dst_dtype), t.region.lengths))
            op = _Op(message.nbytes, items)
            # A lone dense slice already in the wire dtype moves in place: no staging, no copy.
            only = message.slices[0].transfer
            if len(items) == 1 and items[0][0].is_contiguous() and not (sending and _casts(only)):
                op.direct = as_bytes(items[0][0])
            return op

        chunks = [
            _BoundChunk(
                chunk.index,
                [
                    _BoundBatch(b, [bind(m, True) for m in b.sends], [bind(m, False) for m in b.recvs])
                    for b in chunk.batches
                ],
            )
            for chunk in self.schedule.chunks
        ]
        return local, chunks

    def _local_tensor(
        self,
        kind: str,
        tensors: Mapping[str, torch.Tensor],
        name: str,
        dtype: str,
        checked: set[tuple[str, str]],
    ) -> torch.Tensor:
        tensor = tensors.get(name)
        if (kind, name) in checked and tensor is not None:
            return tensor
        if tensor is None:
            raise ShardError(f"{name}: rank {self.rank} has no local {kind} tensor for it")
        box = self._shards[kind][name].box_of(self.rank)
        assert box is not None  # the plan only routes shards this rank holds
        if tuple(tensor.shape) != box.lengths:
            raise ShardError(
                f"{name}: the local {kind} on rank {self.rank} has shape {tuple(tensor.shape)}, its shard is "
                f"{list(box.lengths)}"
            )
        if tensor.dtype != torch_dtype(dtype):
            raise ShardError(
                f"{name}: the local {kind} on rank {self.rank} is {tensor.dtype}, expected {dtype}"
            )
        if tensor.device != self.device:
            raise ShardError(
                f"{name}: the local {kind} on rank {self.rank} is on {tensor.device}, "
                f"the exchange on {self.device}"
            )
        checked.add((kind, name))
        return tensor

    def _preflight(self, *, failed: bool, n_chunks: int) -> int:
        """One MAX all-reduce: who failed to bind, and the chunk count every rank will walk."""
        votes = torch.zeros(self.world + 1, dtype=torch.int64, device=self.device)
        votes[self.rank] = int(failed)
        votes[self.world] = n_chunks
        work = dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if not self._wait([work], time.monotonic() + self.config.timeout_s):
            self._abort_quietly()
            waited = f"{self.config.timeout_s:g} s"
            raise P2PError(
                f"rank {self.rank}: the group did not meet to start the run within {waited}: {_GONE}"
            )
        values = votes.tolist()
        bad = [r for r, f in enumerate(values[: self.world]) if f]
        if bad and not failed:
            raise P2PError(f"rank {self.rank}: rank(s) {bad} rejected their local tensors; nothing was sent")
        return int(values[self.world])

    # -- the chunk loop ------------------------------------------------------------------------------------

    def _exchange(
        self, chunks: list[_BoundChunk], arena: Arena, trace: list[TraceEvent], start: float
    ) -> None:
        """Post chunk c (pack, then the peer batches in round order), then drain chunk c - depth + 1.

        On CUDA a drain only orders streams and queues the unpacking: staging reuse is safe by stream order,
        so the host never waits for the wire here. It confirms finished chunks lazily (for timeouts and
        the trace) and blocks only when too much work is queued. On CPU transports a drain waits."""
        in_flight: deque[tuple[int, list[_Posted]]] = deque()
        unconfirmed: deque[tuple[int, list[_Posted], int]] = deque()
        n = len(chunks)
        keep = 0 if self.config.trace else _RUN_AHEAD_CHUNKS
        for chunk in chunks:
            self._confirm(unconfirmed, keep, n, trace, start)
            in_flight.append((chunk.index, self._post(chunk, arena.slot(chunk.index), trace, start)))
            if len(in_flight) >= self.config.pipeline_depth:
                self._drain(*in_flight.popleft(), unconfirmed, n, trace, start)
        while in_flight:
            self._drain(*in_flight.popleft(), unconfirmed, n, trace, start)
        self._confirm(unconfirmed, 0, n, trace, start)

    def _post(
        self, chunk: _BoundChunk, slot: torch.Tensor, trace: list[TraceEvent], start: float
    ) -> list[_Posted]:
        offset = 0
        for b in chunk.batches:
            for op in b.sends + b.recvs:
                if op.direct is None:
                    op.staging = slot[offset : offset + op.nbytes]
                    offset += aligned(op.nbytes)
            for op in b.sends:
                if op.staging is not None:
                    for view, at, dtype, shape in op.items:
                        typed_view(op.staging, at, dtype, shape).copy_(view)
        posted = []
        for b in chunk.batches:
            peer = b.batch.peer
            sends = [self._p2p(dist.isend, op, peer, chunk.index, k) for k, op in enumerate(b.sends)]
            recvs = [self._p2p(dist.irecv, op, peer, chunk.index, k) for k, op in enumerate(b.recvs)]
            if self.config.one_batch_per_peer:
                groups = [sends + recvs]
            else:
                # Message k of each direction together: still symmetric between the two ends, so just as
                # deadlock-free, but NCCL gets one small group per launch instead of one long one.
                groups = [sends[k : k + 1] + recvs[k : k + 1] for k in range(max(len(sends), len(recvs)))]
            works = [w for g in groups for w in dist.batch_isend_irecv(g) if w is not None]
            self._trace(trace, start, chunk.index, b, "enqueued")
            posted.append(_Posted(b, works))
        return posted

    def _p2p(self, kind: Callable, op: _Op, peer: int, chunk: int, k: int) -> dist.P2POp:
        buffer = op.direct if op.direct is not None else op.staging
        # Tags keep messages apart on transports that match by tag (gloo); NCCL ignores them.
        tag = (chunk * _TAGS_PER_CHUNK + k) % _TAG_LIMIT
        return dist.P2POp(kind, buffer, group=self.group, group_peer=peer, tag=tag)

    def _drain(
        self,
        index: int,
        posted: list[_Posted],
        unconfirmed: deque[tuple[int, list[_Posted], int]],
        n_chunks: int,
        trace: list[TraceEvent],
        start: float,
    ) -> None:
        launches = 0
        for p in posted:
            if self._polls:
                for w in p.works:
                    w.wait()  # NCCL: the current stream waits for the wire; the host goes on
            else:
                self._await(p, index, n_chunks)
                self._trace(trace, start, index, p.bound, "drained")
            for op in p.bound.sends:
                op.staging = None
            for op in p.bound.recvs:
                if op.staging is not None:
                    for view, at, dtype, shape in op.items:
                        view.copy_(typed_view(op.staging, at, dtype, shape))
                        launches += 1
                    op.staging = None
            launches += len(p.works)
        if self._polls:
            unconfirmed.append((index, posted, launches))

    def _confirm(
        self,
        unconfirmed: deque[tuple[int, list[_Posted], int]],
        keep: int,
        n_chunks: int,
        trace: list[TraceEvent],
        start: float,
    ) -> None:
        """Wait (with the deadline) for the oldest chunks until at most `keep` stay unconfirmed and the
        work queued behind them is small enough that a stuck peer cannot block the host in a launch."""
        while unconfirmed and (
            len(unconfirmed) > keep or sum(n for _, _, n in unconfirmed) > _MAX_QUEUED_LAUNCHES
        ):
            index, posted, _ = unconfirmed.popleft()
            for p in posted:
                self._await(p, index, n_chunks)
                self._trace(trace, start, index, p.bound, "drained")

    def _await(self, posted: _Posted, chunk: int, n_chunks: int) -> None:
        batch = posted.bound.batch
        try:
            done = self._wait(posted.works, time.monotonic() + self.config.timeout_s)
        except RuntimeError as exc:
            raise P2PError(
                f"rank {self.rank}: exchange with peer {batch.peer} failed "
                f"in chunk {chunk + 1} of {n_chunks}: {exc}"
            ) from exc
        if not done:
            self._timed_out(
                batch.peer,
                f"chunk {chunk + 1} of {n_chunks}, round {batch.round}, sending {batch.send_bytes} B, "
                f"receiving {batch.recv_bytes} B",
                chunk=chunk,
                round_=batch.round,
            )

    def _wait(self, works: list, deadline: float) -> bool:
        """Whether `works` completed before `deadline`. NCCL works are polled (their wait() only orders
        streams); CPU transports block in a wait() that is given the remaining time."""
        if self._polls:
            spins = 0
            while not all(w.is_completed() for w in works):
                if time.monotonic() > deadline:
                    return False
                # Yield first (sleep granularity on VMs can exceed a chunk's time on the wire), then back off.
                spins += 1
                time.sleep(0 if spins < _POLL_SPINS else _POLL_SLEEP_S)
            for w in works:
                w.wait()
            return True
        for w in works:
            try:
                w.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError:
                if time.monotonic() >= deadline:
                    return False
                raise
        return True

    def _timed_out(self, peer: int, where: str, *, chunk: int, round_: int) -> NoReturn:
        waited = f"{self.config.timeout_s:g} s"
        message = f"rank {self.rank}: no progress for {waited} waiting on peer {peer} ({where}): {_GONE}"
        log.error(message)
        self._abort_quietly()
        raise PeerTimeoutError(message, peer=peer, chunk=chunk, round_=round_)

    def _abort_quietly(self) -> None:
        try:
            self.abort()
        except Exception:  # best effort: the timeout is the error worth reporting
            log.exception("rank %d: aborting the process group failed", self.rank)

    def _connect(self) -> None:
        """NCCL opens a peer connection on the first send/recv with it, blocking the host until the peer
        joins; done here, where every rank has just met, a later stall shows up in a wait we can time."""
        if not self._polls:
            return
        peers = {b.peer: b.round for c in self.schedule.chunks for b in c.batches}
        for peer, round_ in sorted(peers.items(), key=lambda item: item[1]):
            out = torch.zeros(_CONNECT_BYTES, dtype=torch.uint8, device=self.device)
            back = torch.empty(_CONNECT_BYTES, dtype=torch.uint8, device=self.device)
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, out, group=self.group, group_peer=peer),
                    dist.P2POp(dist.irecv, back, group=self.group, group_peer=peer),
                ]
            )
            if not self._wait([w for w in works if w is not None], time.monotonic() + self.config.timeout_s):
                self._timed_out(peer, f"connecting, round {round_}", chunk=-1, round_=round_)

    def _trace(self, trace: list[TraceEvent], start: float, chunk: int, b: _BoundBatch, event: str) -> None:
        if not self.config.trace:
            return
        item = TraceEvent(
            chunk,
            b.batch.round,
            b.batch.peer,
            event,
            b.batch.send_bytes,
            b.batch.recv_bytes,
            time.perf_counter() - start,
        )
        trace.append(item)
        log.info(
            "p2p rank %d chunk %d round %d peer %d %s send=%dB recv=%dB t=%.6fs",
            self.rank,
            chunk,
            item.round,
            item.peer,
            event,
            item.send_bytes,
            item.recv_bytes,
            item.seconds,
        )


def _payload(schedule: RankSchedule, *, sending: bool) -> int:
    return sum(
        piece.transfer.wire_bytes
        for chunk in schedule.chunks
        for b in chunk.batches
        for m in (b.sends if sending else b.recvs)
        for piece in m.slices
    )


def _casts(t: Transfer) -> bool:
    return t.src_dtype != t.dst_dtype


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives of `group` run on: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
