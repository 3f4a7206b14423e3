"""The reader's `Exchange` over runtime/p2p: what a GPU's targets need from the trainer shards of other GPUs.

Setup, once per process group (one SGLang rank per GPU, collective): every rank knows both layouts, the
trainer's (rank r = the trainer shard published on the GPU of group rank r) and the inference engine's (rank
r = the targets of group rank r). Each rank computes them from converter metadata for every rank
(`trainer_plan(...).rank_shards(r)`, `inference_plan(...).rank_shards(r)`), or states only its own and
`gather_layout` collects them through the group (JSON, never pickle). `ReshardExchange.create` then builds
the p2p plan once; `P2PExchange.create` checks that every rank built the same one. Each step reuses it.

Local versus exchanged elements: the reader copies, from its own GPU's buckets, the intersection of the
trainer shard on its GPU with each target; the exchange moves everything else and nothing more
(`run(..., local=False)`). The plan agrees by construction: its sender pieces are disjoint (identical replicas
merged, partial overlaps refused) and a receiver that holds a piece is always its own source, so its local
transfers are exactly that intersection. Each step checks the premise before anything moves: the manifest's
entries are this rank's trainer shards, and the regions the reader still misses are what the plan receives.

Failure: each step begins with one all-reduce (the ballot: every rank's verdict, step and weight version).
A rank whose step failed before reaching the exchange takes part through `abandon`, which the reader calls,
so a bad manifest, an abort or a trainer that never published on one GPU makes every rank raise as soon as
that GPU gives up (its step timeout), and the group stays usable for the next step. A rank that never comes
at all (stuck, dead) is bounded by `agree_timeout_s`; after such a timeout, or a p2p timeout, the group
cannot be trusted and every later call raises at once: restart the workers.

Slices from other GPUs land in the targets (SGLang's own parameters) without a staging copy where each is one
dense run of its target (runtime/p2p/program.py; `last_report.received_in_place` against `received_staged`).
Nothing is received before the ballot and the executor's own start vote have passed; a failure after them
leaves the exchanged regions partly written (runtime/p2p/executor.py says how), beside the reader's local
copy, and the step fails: its targets hold no version.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any

import torch
import torch.distributed as dist

from colocate_runtime.colocated.exchange_seam import ExchangeRequest
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.p2p.config import ExecutorConfig
from colocate_runtime.p2p.errors import P2PError, PeerTimeoutError
from colocate_runtime.p2p.executor import P2PExchange, RunReport, default_device
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.p2p.waiting import GONE, Deadlines
from colocate_runtime.shards import Box, RankShards, ShardError, TensorShard, stable_hash

log = logging.getLogger(__name__)

# A rank's verdict in the ballot: 0 = ready; else why it cannot exchange this step. "layout": its manifest or
# targets do not match the layouts; the others are StepFailed.result values of a step that failed earlier.
VERDICTS = ("ok", "layout", "error", "aborted", "timeout", "peer_lost", "metastore_lost")


class ExchangeFailed(StepFailed):
    """The cross-GPU part of a step failed on this rank or another; nothing or not all was exchanged."""


class ReshardExchange:
    """`Exchange` for a `WeightReader`: one per process, reused every step. Also call `abandon` (the reader
    does) when a step fails before the exchange, and call the reader on every rank once per step."""

    def __init__(self, p2p: P2PExchange, *, agree_timeout_s: float | None = None) -> None:
        self.p2p = p2p
        self.rank, self.world = p2p.rank, p2p.world
        self.agree_timeout_s = agree_timeout_s or p2p.config.timeout_s
        self._ballot = Deadlines(p2p.group, self.rank, self.agree_timeout_s)
        self._sources = _boxes(p2p.senders, self.rank)
        self._targets = _boxes(p2p.receivers, self.rank)
        self._incoming: dict[str, int] = {}  # elements of each target that other ranks send here
        self._outgoing: set[str] = set()
        for t in p2p.plan.transfers:
            if t.dst == self.rank and t.src != self.rank:
                self._incoming[t.name] = self._incoming.get(t.name, 0) + t.numel
            elif t.src == self.rank and t.dst != self.rank:
                self._outgoing.add(t.name)
        self._broken: str | None = None
        self.last_report: RunReport | None = None

    @classmethod
    def create(
        cls,
        trainer: Layout,
        inference: Layout,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        config: ExecutorConfig | None = None,
        agree_timeout_s: float | None = None,
    ) -> ReshardExchange:
        """Collective over `group`: every rank passes the same two layouts. `agree_timeout_s` (default: the
        p2p timeout) bounds how long a rank waits for its peers to reach a step; make it at least the
        readers' step timeout, since a peer may legitimately arrive (or give up) that much later."""
        p2p = P2PExchange.create(trainer, inference, group=group, device=device, config=config)
        log.info(
            "rank %d: reshard plan %s: receives %d B and sends %d B per step",
            p2p.rank,
            p2p.plan.hash(),
            p2p.plan.received_bytes().get(p2p.rank, 0),
            p2p.plan.sent_bytes().get(p2p.rank, 0),
        )
        return cls(p2p, agree_timeout_s=agree_timeout_s)

    def target_shards(self) -> dict[str, TensorShard]:
        """This rank's inference shards, for the reader's `target_shards`."""
        return {s.name: s for s in self.p2p.receivers.rank_shards(self.rank).shards}

    # --- the reader's seam --------------------------------------------------------------------------------

    def __call__(self, request: ExchangeRequest) -> set[str]:
        step = request.manifest.step
        try:
            problem = self._mismatch(request)
        except Exception as exc:  # whatever happens, this rank must still vote, or its peers wait
            problem = f"rank {self.rank}, step {step}: the request could not be checked: {exc!r}"
        try:
            self._agree("layout" if problem else "ok", step, request.manifest.weight_version, problem=problem)
            sources = {name: request.local[name] for name in self._outgoing}
            targets = {name: request.missing[name] for name in self._incoming}
            self.last_report = self.p2p.run(sources, targets, local=False)
        except (P2PError, ShardError, RuntimeError) as exc:
            raise self._failed(step, exc) from exc
        return set(request.missing)

    def abandon(self, error: BaseException) -> None:
        """This rank's step failed before the exchange: vote so its peers fail now, not at their timeout."""
        if self._broken is not None:
            return
        verdict = getattr(error, "result", "error")
        try:
            self._agree(verdict if verdict in VERDICTS[2:] else "error", None, None, problem=str(error))
        except (P2PError, RuntimeError) as exc:
            raise self._failed(getattr(error, "step", None), exc) from None

    # --- agreement ----------------------------------------------------------------------------------------

    def _agree(self, verdict: str, step: int | None, version: str | None, *, problem: str | None) -> None:
        """One MAX all-reduce of per-rank slots: verdict, step + 1 (0: unknown) and a version digest.
        Raises unless every rank is ready for the same step and version."""
        if self._broken is not None:
            raise P2PError(f"rank {self.rank}: {self._broken}")
        world = self.world
        votes = [0] * (3 * world)
        votes[self.rank] = VERDICTS.index(verdict)
        votes[world + self.rank] = 0 if step is None else step + 1
        votes[2 * world + self.rank] = 0 if version is None else int(stable_hash(version)[:15], 16)
        ballot = torch.tensor(votes, dtype=torch.int64).to(self.p2p.device)
        work = dist.all_reduce(ballot, op=dist.ReduceOp.MAX, group=self.p2p.group, async_op=True)
        try:
            self._ballot.wait_for_group([work], f"the ballot of step {step}")
        except P2PError:
            raise
        except RuntimeError as exc:  # the transport failed (a peer died): the group is gone too
            raise P2PError(f"rank {self.rank}: the ballot of step {step} failed ({exc}): {GONE}") from exc
        values = ballot.tolist()
        verdicts, steps, versions = values[:world], values[world : 2 * world], values[2 * world :]
        if verdict != "ok":
            if problem is not None and verdict == "layout":
                raise ShardError(problem)
            return
        failed = {r: VERDICTS[v] for r, v in enumerate(verdicts) if v}
        if failed:
            listed = ", ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
            raise P2PError(f"rank {self.rank}: step {step} failed on {listed} before anything moved")
        if len(set(steps)) > 1 or len(set(versions)) > 1:
            listed = ", ".join(f"rank {r}: step {s - 1}" for r, s in enumerate(steps))
            raise P2PError(
                f"rank {self.rank}: ranks are applying different steps or weight versions ({listed}); "
                "nothing moved"
            )

    def _mismatch(self, request: ExchangeRequest) -> str | None:
        """Why this step cannot be exchanged as planned (the rule in the module docstring), or None."""
        where = f"rank {self.rank}, step {request.manifest.step}"
        entries = request.local_entries
        if entries.keys() != self._sources.keys():
            lost = sorted(self._sources.keys() - entries.keys())[:5]
            extra = sorted(entries.keys() - self._sources.keys())[:5]
            return (
                f"{where}: the manifest is not this rank's trainer shard (missing {lost}, unexpected {extra})"
            )
        for name, (box, shape) in self._sources.items():
            e = entries[name]
            got = (e.shard.box, e.shard.global_shape) if e.shard is not None else (Box.full(e.shape), e.shape)
            if got != (box, shape):
                return (
                    f"{where}: {name}: the trainer published box {got[0].to_json()} of {list(got[1])}, the "
                    f"trainer layout says {box.to_json()} of {list(shape)}"
                )
        for name, target in request.missing.items():
            shard = request.target_shards.get(name)
            box = shard.box if shard is not None else Box.full(tuple(target.shape))
            planned = self._targets.get(name)
            if planned is None or planned[0] != box:
                said = None if planned is None else planned[0].to_json()
                return f"{where}: {name}: the reader needs box {box.to_json()}, the inference layout {said}"
            need = sum(b.numel for b in request.missing_boxes[name])
            if need != self._incoming.get(name, 0):
                return (
                    f"{where}: {name}: {need} elements are missing after the local copy, the plan sends "
                    f"{self._incoming.get(name, 0)} here"
                )
        unasked = sorted(self._incoming.keys() - request.missing.keys())
        if unasked:
            return f"{where}: the plan sends {unasked[:5]} here, but the reader does not miss them"
        return None

    def _failed(self, step: int | None, exc: BaseException) -> ExchangeFailed:
        # The chained error's frames may hold views of the mapped buckets: cleared, or the close would fail.
        cause: BaseException | None = exc
        seen: set[int] = set()
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__ or cause.__context__
        # A timeout or a transport error may leave a collective pending: this group can no longer be trusted.
        gone = (
            isinstance(exc, PeerTimeoutError) or GONE in str(exc) or isinstance(exc.__cause__, RuntimeError)
        )
        if gone or type(exc) is RuntimeError:
            self._broken = f"an earlier exchange left the process group unusable ({exc}); restart the workers"
        return ExchangeFailed(f"exchange of step {step}: {exc}", step=step)


def _boxes(layout: Layout, rank: int) -> dict[str, tuple[Box, tuple[int, ...]]]:
    return {s.name: (s.box, s.global_shape) for s in layout.rank_shards(rank).shards}


def allgather_json(obj: Any, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """Collective over `group` (None: the default group): every rank's JSON-able `obj`, in rank order. Two
    all-gathers: the sizes, then the bytes padded to the largest."""
    world = dist.get_world_size(group)
    blob = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    gathered = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    return [json.loads(bytes(g[:n].cpu().tolist())) for g, n in zip(gathered, lengths, strict=True)]


def gather_layout(
    own: RankShards, *, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Layout:
    """Collective: each rank states what it holds (`own.rank` = its rank in `group`); every rank gets the
    whole layout. JSON over two all-gathers (sizes, then padded bytes)."""
    device = device or default_device(group)
    rank = dist.get_rank(group)
    ranks = [RankShards.from_json(data) for data in allgather_json(own.to_json(), group, device)]
    wrong = [(r, s.rank) for r, s in enumerate(ranks) if s.rank != r]
    if wrong:  # every rank sees the same data, so every rank raises
        raise ShardError(
            f"rank {rank}: ranks stated shards under other rank ids (group rank, stated): {wrong}"
        )
    return Layout.from_ranks(ranks)
