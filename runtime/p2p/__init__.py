"""Cross-GPU resharding: per-parameter layouts, a deterministic transfer plan, and a chunked executor.

Layers only look down: `layout` and `plan` (pure metadata), `peers` and `chunks` (pure scheduling), then
`staging` and `executor` (torch, torch.distributed). The pure layers are imported eagerly; the executor only
on first use, so planning never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colocate_runtime.p2p.chunks import ChunkPlan, RankSchedule, assign_chunks, rank_schedule
from colocate_runtime.p2p.config import ExecutorConfig
from colocate_runtime.p2p.errors import P2PError, PeerTimeoutError, PlanMismatchError
from colocate_runtime.p2p.layout import Layout, ParamShards, split_box, split_extent
from colocate_runtime.p2p.plan import PlanError, Transfer, TransferPlan, build_plan

if TYPE_CHECKING:
    from colocate_runtime.p2p.executor import P2PExchange, RunReport, TraceEvent

__all__ = [
    "ChunkPlan",
    "ExecutorConfig",
    "Layout",
    "P2PError",
    "P2PExchange",
    "ParamShards",
    "PeerTimeoutError",
    "PlanError",
    "PlanMismatchError",
    "RankSchedule",
    "RunReport",
    "TraceEvent",
    "Transfer",
    "TransferPlan",
    "assign_chunks",
    "build_plan",
    "rank_schedule",
    "split_box",
    "split_extent",
]

_LAZY = {"P2PExchange", "RunReport", "TraceEvent"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from colocate_runtime.p2p import executor

        return getattr(executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
