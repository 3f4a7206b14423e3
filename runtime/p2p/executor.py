"""Runs a plan over torch.distributed: chunked, packed per peer, peers met in the circle order.

One process group, one rank per device. A rank may send, receive or both (colocated trainer and inference
shards on the same GPU), so disjoint sender and receiver sets are just the special case where some ranks hold
nothing on one side. Per chunk and per peer, small slices travel packed in one buffer and large ones as their
own messages, all cast to the receiver's dtype by the sender (byte counts always match). Every rank walks
every chunk and every round in the same order, empty ones included, so no rank leaves while a peer waits.

Everything that can fail locally (plan, tensor shapes, dtypes) is checked before the first byte moves, and
the outcome is agreed with one all-reduce, so a bad rank makes every rank raise instead of leaving its peers
waiting. Waits poll with a deadline: a stuck peer becomes a `PeerTimeoutError` naming it.

Targets change only after that vote: the local copies and every receive, in place or staged, are posted
after it (the first chunk packed while it is on its way writes only the rank's own staging), so a run that
fails the vote leaves every target as it was. A peer lost after the vote leaves targets partly written
either way: through staging, the chunks unpacked before the failure are written and later ones are not; a
message received in place (program.py) may in addition leave its own region half written, since it lands
while on the wire. Neither is a usable set of weights: the run raises, and the caller must not take the
targets for any version (the colocated reader fails the step and says so in its ACK; the next step that
succeeds writes every target byte again).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.p2p.binding import SOURCE, TARGET, BatchWork, LocalTensors, Spec, resolve
from colocate_runtime.p2p.chunks import ChunkPlan, RankSchedule, plan_chunks, rank_schedule, shard_shapes
from colocate_runtime.p2p.config import ExecutorConfig
from colocate_runtime.p2p.errors import P2PError, PlanMismatchError
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.p2p.plan import (
    PlanError,
    TransferPlan,
    build_plan,
    describe_shards,
    fingerprint,
    first_difference,
)
from colocate_runtime.p2p.program import Program, Step, buffer, copy_all, local_copies, region
from colocate_runtime.p2p.waiting import Deadlines
from colocate_runtime.shards import ShardError

log = logging.getLogger("colocate_runtime.p2p")

# Chunks the host may post before confirming older ones, and the queued launches (copies and messages)
# behind unconfirmed chunks beyond which it waits: a stuck peer must show up as a timeout, not as the host
# blocking in a full CUDA launch queue.
_RUN_AHEAD_CHUNKS = 4
_MAX_QUEUED_LAUNCHES = 512
# Bytes exchanged with each peer when the exchange is created, to open the NCCL connection up front.
_CONNECT_BYTES = 1 << 20
_TAGS_PER_CHUNK = 1 << 12
_TAG_LIMIT = (1 << 31) - 1


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
    # bytes_received split by how they landed: straight into the targets, or staged and then unpacked
    received_in_place: int
    received_staged: int
    sent_in_place: int  # bytes_sent split the same way: from the sources themselves, or packed first
    sent_staged: int
    seconds: float
    trace: tuple[TraceEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A peer batch's ops, ready to launch."""

    step: Step
    groups: list[list[dist.P2POp]]


@dataclass(slots=True)
class _Run:
    """One run's state, shared by the chunk loop's steps: where data comes from and goes, what is posted and
    not yet confirmed, and the trace."""

    sources: Mapping[str, torch.Tensor]
    targets: Mapping[str, torch.Tensor]
    n_chunks: int
    start: float  # perf_counter at the run's start: trace times are relative to it
    trace: list[TraceEvent]
    # Drained on CUDA but not yet waited for: (chunk, its batches, the launches queued behind them).
    unconfirmed: deque[tuple[int, list[_Posted], int]] = field(default_factory=deque)


@dataclass(slots=True)
class _Posted:
    """A peer batch on the wire; its staged received messages are unpacked when it is drained."""

    step: Step
    works: list

    @property
    def work(self) -> BatchWork:
        return self.step.work


class P2PExchange:
    """A reshard between two layouts over one process group, set up once and run every weight sync."""

    def __init__(
        self,
        *,
        senders: Layout,
        receivers: Layout,
        plan: TransferPlan,
        chunk_plan: ChunkPlan,
        schedule: RankSchedule,
        group: dist.ProcessGroup | None,
        device: torch.device,
        config: ExecutorConfig,
        budget: int | None = None,
    ) -> None:
        self.senders = senders
        self.receivers = receivers
        self.plan = plan
        self.chunk_plan = chunk_plan
        self.schedule = schedule
        self.group = group
        self.device = device
        self.config = config
        self.budget = budget if budget is not None else config.budget_bytes  # agreed: the smallest configured
        self.rank = schedule.rank
        self.world = schedule.world
        self._deadlines = Deadlines(group, self.rank, config.timeout_s)
        self._polls = self._deadlines.polls
        self._work = resolve(schedule, senders, receivers)
        self._shards = {
            SOURCE: _local_shards(senders, self.rank),
            TARGET: _local_shards(receivers, self.rank),
        }
        self._remote = {
            SOURCE: _names(self._work, sending=True),
            TARGET: _names(self._work, sending=False),
        }
        needed = {
            SOURCE: {t.name for t in schedule.local} | self._remote[SOURCE],
            TARGET: {t.name for t in schedule.local} | self._remote[TARGET],
        }
        self._shapes = {kind: {n: shape for n, (shape, _) in s.items()} for kind, s in self._shards.items()}
        # Programs by which tensors of movable messages are dense: usually one for the exchange's life.
        self._movable = tuple(
            sorted(
                {(SOURCE, w.pieces[0].name) for c in self._work for b in c for w in b.sends if w.movable}
                | {(TARGET, w.pieces[0].name) for c in self._work for b in c for w in b.recvs if w.movable}
            )
        )
        # The per-run checks, worked out once: with and without the plan's local copies.
        self._specs = {local: self._checks(needed if local else self._remote) for local in (True, False)}
        self._programs: dict[tuple[bool, ...], Program] = {}
        # The start vote, by whether this rank failed to bind: ballots in page-locked memory on CUDA, so a run
        # starts the vote with an asynchronous copy instead of building and copying a tensor.
        pinned = device.type == "cuda"
        self._ballots = tuple(
            torch.tensor(
                [int(failed and r == self.rank) for r in range(self.world)] + [len(self._work)],
                dtype=torch.int64,
                pin_memory=pinned,
            )
            for failed in (False, True)
        )
        self._votes = torch.empty(self.world + 1, dtype=torch.int64, device=device)
        self._local_copies = local_copies(schedule.local, self._shapes[SOURCE], self._shapes[TARGET])
        self._bytes_sent = _payload(schedule, sending=True)
        self._bytes_received = _payload(schedule, sending=False)
        self._bytes_local = sum(t.wire_bytes for t in schedule.local)

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
        ranks built the same one (by hash), agrees on the chunk budget and message threshold (the smallest
        configured) and opens the peer connections."""
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
        # One MAX all-reduce: failure flags and digests in per-rank slots, negated settings for a MIN.
        votes = torch.zeros(2 * world + 3, dtype=torch.int64, device=device)
        votes[rank] = int(error is not None)
        votes[world + rank] = digest
        votes[2 * world] = -config.budget_bytes
        votes[2 * world + 1] = -config.direct_min_bytes
        votes[2 * world + 2] = config.pipeline_depth
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        values = votes.tolist()
        flags, digests = values[:world], values[world : 2 * world]
        budget, direct_min, depth = -values[2 * world], -values[2 * world + 1], values[2 * world + 2]
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
            what = _plan_difference(senders, receivers, plan, group, device, world)  # collective
            raise PlanMismatchError(
                f"rank {rank}: ranks built different plans ({groups}); first difference: {what}; "
                "nothing was sent"
            )
        chunk_plan = plan_chunks(plan, budget, depth, shard_shapes(senders, receivers), direct_min)
        exchange = cls(
            senders=senders,
            receivers=receivers,
            plan=plan,
            chunk_plan=chunk_plan,
            schedule=rank_schedule(chunk_plan, rank, world, direct_min),
            group=group,
            device=device,
            config=config,
            budget=budget,
        )
        exchange._connect()
        return exchange

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        *,
        local: bool = True,
    ) -> RunReport:
        """Collective: move this rank's `sources` (its sender shards, by name) into every receiver's `targets`
        (its receiver shards, by name). Tensors must have their shard's shape, dtype and this exchange's
        device; they may be non-contiguous views. Returns after the data is in place. Targets are written
        only once every rank has voted to start; if the run raises after that, they may be partly written
        (the module docstring says how).

        `local=False` skips the plan's local transfers (sender and receiver both this rank), for a caller that
        has already copied those elements itself (the colocated reader); tensors only they need may then be
        left out."""
        start = time.perf_counter()
        with torch.no_grad():
            error: Exception | None = None
            bound: LocalTensors | None = None
            try:
                bound = LocalTensors(
                    self.rank, self.device, self._specs[local], {SOURCE: sources, TARGET: targets}
                )
            except ShardError as exc:
                error = exc
            vote = self._vote(failed=error is not None)
            first = None
            if bound is not None:
                # While the vote is on its way: the first chunk's ops, and its packing into this rank's own
                # staging. Nothing leaves the rank and no target changes before every rank has agreed.
                program = self._program(bound)
                program.arena.acquire()
                if program.chunks:
                    first = self._prepare(0, program.chunks[0], bound)
                    self._pack(first, bound.tensors(SOURCE))
            try:
                n_chunks = self._tally(vote, failed=error is not None)
            except BaseException:
                if bound is not None:
                    program.arena.release()  # freed in stream order: after the packing copies
                raise
            if error is not None:
                raise error
            assert bound is not None
            work = list(program.chunks) + [() for _ in range(len(program.chunks), n_chunks)]
            state = _Run(bound.tensors(SOURCE), bound.tensors(TARGET), len(work), start, [])
            try:
                self._exchange(work, bound, state, local, program.depth, first)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            except BaseException:
                # Work may still reference the staging: let the allocator free it when that is done
                # (stream-ordered, as for any tensor) instead of shrinking it under the wire.
                self._programs.clear()
                raise
            program.arena.release()
        return RunReport(
            rank=self.rank,
            n_chunks=n_chunks,
            batches=sum(len(chunk) for chunk in work),
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            bytes_local=self._bytes_local if local else 0,
            staging_bytes=program.arena.nbytes,
            received_in_place=program.in_place[TARGET],
            received_staged=program.staged[TARGET],
            sent_in_place=program.in_place[SOURCE],
            sent_staged=program.staged[SOURCE],
            seconds=time.perf_counter() - start,
            trace=tuple(state.trace),
        )

    def abort(self) -> None:
        """Tear the NCCL communicator down (done on every timeout) so stuck kernels cannot outlive it."""
        self._deadlines.abort()

    def _checks(self, needed: Mapping[str, set[str]]) -> dict[str, tuple[Spec, ...]]:
        movable = set(self._movable)
        return {
            kind: tuple(
                (name, *self._shards[kind][name], (kind, name) in movable) for name in sorted(needed[kind])
            )
            for kind in (SOURCE, TARGET)
        }

    def _program(self, bound: LocalTensors) -> Program:
        program = self._programs.get(bound.signature)
        if program is None:
            program = Program(
                self._work, bound, self._shapes, self.config.pipeline_depth, self.budget, self.device
            )
            self._programs[bound.signature] = program
        return program

    # -- agreement -----------------------------------------------------------------------------------------

    def _vote(self, *, failed: bool) -> dist.Work:
        """Start one MAX all-reduce: who failed to bind, and the chunk count every rank will walk."""
        self._votes.copy_(self._ballots[failed], non_blocking=True)
        work = dist.all_reduce(self._votes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        return work

    def _tally(self, work: dist.Work, *, failed: bool) -> int:
        self._deadlines.wait_for_group([work], "the all-reduce that starts the run")
        values = self._votes.tolist()
        bad = [r for r, f in enumerate(values[: self.world]) if f]
        if bad and not failed:
            raise P2PError(f"rank {self.rank}: rank(s) {bad} rejected their local tensors; nothing was sent")
        return int(values[self.world])

    def _connect(self) -> None:
        """NCCL opens a peer connection on the first send/recv with it, blocking the host until the peer
        joins; done here, where every rank has just met, a later stall shows up in a wait we can time."""
        if not self._polls:
            return
        self._load_copy_kernels()
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
            self._deadlines.wait_for_peer(
                [w for w in works if w is not None],
                peer,
                f"connecting, round {round_}",
                chunk=-1,
                round_=round_,
            )

    def _load_copy_kernels(self) -> None:
        """Make every kind of copy a run makes once, now: CUDA loads a kernel on its first launch, and that
        can block the host while NCCL kernels run (with a stuck peer, where no deadline fires)."""
        src = {n: dtype for n, (_, dtype) in self._shards[SOURCE].items()}
        dst = {n: dtype for n, (_, dtype) in self._shards[TARGET].items()}
        pairs = {(src[c.src], dst[c.dst]) for c in self._local_copies}
        for chunk in self._work:
            for b in chunk:
                pairs |= {(src[p.name], p.dtype) for w in b.sends for p in w.pieces}
                pairs |= {(p.dtype, dst[p.name]) for w in b.recvs for p in w.pieces}
        for src_dtype, dst_dtype in pairs:
            one = torch.zeros(1, dtype=src_dtype, device=self.device)
            copy_all([torch.empty(1, dtype=dst_dtype, device=self.device)], [one])

    # -- the chunk loop ------------------------------------------------------------------------------------

    def _exchange(
        self,
        work: list[tuple[Step, ...]],
        bound: LocalTensors,
        run: _Run,
        local: bool,
        depth: int,
        first: list[_Prepared] | None = None,
    ) -> None:
        """Post chunk c (pack, then the peer batches in round order), then drain chunk c - depth + 1.

        On CUDA a drain only orders streams and queues the unpacking: staging reuse is safe by stream order,
        so the host never waits for the wire here. It confirms finished chunks lazily (for timeouts and
        the trace) and blocks only when too much work is queued. On CPU transports a drain waits.
        The local copies go first: queued behind a first chunk whose peer was stuck, a copy blocked the
        host inside the launch (seen on H200; probably CUDA's lazy loading of a kernel used for the first
        time), where no deadline can fire."""
        in_flight: deque[tuple[int, list[_Posted]]] = deque()
        keep = 0 if self.config.trace else _RUN_AHEAD_CHUNKS
        if local:
            self._copy_local(run.sources, run.targets)
        for index, chunk in enumerate(work):
            self._confirm(run, keep)
            if index == 0 and first is not None:
                prepared = first  # prepared and packed while the start vote was on its way
            else:
                prepared = self._prepare(index, chunk, bound)
                self._pack(prepared, run.sources)
            in_flight.append((index, self._post(run, index, prepared)))
            if len(in_flight) >= depth:
                self._drain(run, *in_flight.popleft())
        while in_flight:
            self._drain(run, *in_flight.popleft())
        self._confirm(run, 0)

    def _copy_local(self, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> None:
        copies = self._local_copies
        src = [region(sources, c.src, c.src_box) for c in copies]
        copy_all([region(targets, c.dst, c.dst_box) for c in copies], src)

    def _prepare(self, index: int, chunk: tuple[Step, ...], bound: LocalTensors) -> list[_Prepared]:
        """The ops of one chunk, per peer batch (host work only)."""
        sources, targets = bound.tensors(SOURCE), bound.tensors(TARGET)
        out = []
        for step in chunk:
            peer = step.work.batch.peer
            send_ops = [
                self._p2p(dist.isend, buffer(m, sources), peer, index, k) for k, m in enumerate(step.sends)
            ]
            recv_ops = [
                self._p2p(dist.irecv, buffer(m, targets), peer, index, k) for k, m in enumerate(step.recvs)
            ]
            if self.config.bench.one_batch_per_peer:
                groups = [send_ops + recv_ops]
            else:
                # Message k of each direction together: still symmetric between the two ends, so just as
                # deadlock-free, but NCCL gets one small group per launch instead of one long one.
                groups = [
                    send_ops[k : k + 1] + recv_ops[k : k + 1]
                    for k in range(max(len(send_ops), len(recv_ops)))
                ]
            out.append(_Prepared(step, groups))
        return out

    def _pack(self, prepared: list[_Prepared], sources: Mapping[str, torch.Tensor]) -> None:
        parts = [part for p in prepared for m in p.step.sends for part in m.parts]
        copy_all([part.staging for part in parts], [region(sources, part.name, part.box) for part in parts])

    def _post(self, run: _Run, index: int, prepared: list[_Prepared]) -> list[_Posted]:
        posted = []
        for p in prepared:
            works = [w for g in p.groups for w in dist.batch_isend_irecv(g) if w is not None]
            posted.append(_Posted(p.step, works))
            self._trace(run, index, p.step.work, "enqueued")
        return posted

    def _p2p(self, kind: Callable, buffer: torch.Tensor, peer: int, chunk: int, k: int) -> dist.P2POp:
        # Tags keep messages apart on transports that match by tag (gloo); NCCL ignores them.
        tag = (chunk * _TAGS_PER_CHUNK + k) % _TAG_LIMIT
        return dist.P2POp(kind, buffer, group=self.group, group_peer=peer, tag=tag)

    def _drain(self, run: _Run, index: int, posted: list[_Posted]) -> None:
        launches = 0
        for p in posted:
            if self._polls:
                for w in p.works:
                    w.wait()  # NCCL: the current stream waits for the wire; the host goes on
            else:
                self._await(p, index, run.n_chunks)
                self._trace(run, index, p.work, "drained")
            parts = [part for m in p.step.recvs for part in m.parts]
            dst = [region(run.targets, part.name, part.box) for part in parts]
            copy_all(dst, [part.staging for part in parts])
            launches += len(p.works) + p.step.copies
        if self._polls:
            run.unconfirmed.append((index, posted, launches))

    def _confirm(self, run: _Run, keep: int) -> None:
        """Wait (with the deadline) for the oldest chunks until at most `keep` stay unconfirmed and the
        work queued behind them is small enough that a stuck peer cannot block the host in a launch."""
        unconfirmed = run.unconfirmed
        while unconfirmed and (
            len(unconfirmed) > keep or sum(n for _, _, n in unconfirmed) > _MAX_QUEUED_LAUNCHES
        ):
            index, posted, _ = unconfirmed.popleft()
            for p in posted:
                self._await(p, index, run.n_chunks)
                self._trace(run, index, p.work, "drained")

    def _await(self, posted: _Posted, chunk: int, n_chunks: int) -> None:
        batch = posted.work.batch
        where = (
            f"chunk {chunk + 1} of {n_chunks}, round {batch.round}, sending {batch.send_bytes} B, "
            f"receiving {batch.recv_bytes} B"
        )
        self._deadlines.wait_for_peer(posted.works, batch.peer, where, chunk=chunk, round_=batch.round)

    def _trace(self, run: _Run, chunk: int, b: BatchWork, event: str) -> None:
        if not self.config.trace:
            return
        batch = b.batch
        item = TraceEvent(
            chunk,
            batch.round,
            batch.peer,
            event,
            batch.send_bytes,
            batch.recv_bytes,
            time.perf_counter() - run.start,
        )
        run.trace.append(item)
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


def _local_shards(layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for p in layout.params:
        box = p.box_of(rank)
        if box is not None:
            out[p.name] = (box.lengths, torch_dtype(p.dtype))
    return out


def _names(work: tuple[tuple[BatchWork, ...], ...], *, sending: bool) -> set[str]:
    return {
        piece.name
        for chunk in work
        for b in chunk
        for w in (b.sends if sending else b.recvs)
        for piece in w.pieces
    }


def _payload(schedule: RankSchedule, *, sending: bool) -> int:
    return sum(
        piece.transfer.wire_bytes
        for chunk in schedule.chunks
        for b in chunk.batches
        for m in (b.sends if sending else b.recvs)
        for piece in m.slices
    )


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives of `group` run on: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _plan_difference(
    senders: Layout,
    receivers: Layout,
    plan: TransferPlan,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world: int,
) -> str:
    """Collective, only once plan hashes differed: every rank's per-parameter fingerprints (JSON bytes, two
    all-gathers) and the first parameter they disagree on, with this rank's own boxes of it."""
    mine = json.dumps(fingerprint(senders, receivers, plan), separators=(",", ":")).encode()
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    gathered = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded.to(device), group=group)
    try:
        tables = [json.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(gathered, lengths, strict=True)]
        diff = first_difference(tables)
    except (ValueError, TypeError, AttributeError) as err:  # a peer's fingerprints do not decode
        return f"the ranks' fingerprints could not be compared ({err})"
    if diff.name is None:
        return diff.text
    side = senders if diff.part == "sender shards" else receivers
    here = describe_shards(side.by_name().get(diff.name))
    return f"{diff.text}; on this rank its {'senders' if side is senders else 'receivers'} are {here}"
