"""Executor settings, read once at the edge (environment or caller) into a frozen, validated object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from colocate_runtime.contract import env as contract
from colocate_runtime.p2p.chunks import ALIGN, DIRECT_MIN_BYTES

# The variables' names, types and parsing rules are the contract table's (contract/env.py).
ENV_BUDGET_MB = contract.P2P_BUDGET_MB.name
ENV_PIPELINE_DEPTH = contract.P2P_PIPELINE_DEPTH.name
ENV_TIMEOUT_S = contract.P2P_TIMEOUT_S.name
ENV_TRACE = contract.P2P_TRACE.name
ENV_DIRECT_MIN_MB = contract.P2P_DIRECT_MIN_MB.name
_MB = 1 << 20


@dataclass(frozen=True, slots=True)
class ExecutorBenchSwitches:
    """Benchmark-only (bench/p2p_bench.py): a switch brings back a way the executor no longer works, so a
    measurement can compare against it. `from_env` reads none of them.

    one_batch_per_peer: all messages with one peer in one chunk go in one batch_isend_irecv; False posts
        message k of both directions as its own batch (both ends must agree).
    """

    one_batch_per_peer: bool = True


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How the executor may use memory and time.

    budget_bytes: bound on the staging one rank holds at once (packed send and receive buffers of all peers,
        in the receiver's dtype) and on the bytes it sends plus receives in one chunk. With `pipeline_depth`
        chunks in flight, each chunk gets budget / depth, unless the plan stages so little that whole-budget
        chunks still fit `depth` slots of staging (`chunks.plan_chunks`).
    pipeline_depth: chunks in flight; 2 lets packing of the next chunk overlap the wire of the current one.
    timeout_s: longest wait for one peer batch to drain before the run fails naming that peer.
    trace: record (and log at INFO) when each peer batch is enqueued and drained.
    direct_min_bytes: slices at least this big travel as their own message and move in place when their
        tensor is dense (and, sending, already in the wire dtype); smaller ones are packed per peer.
    bench: switches only benchmarks change (`ExecutorBenchSwitches`).
    Ranks agree on the smallest budget and direct_min_bytes and the largest pipeline_depth configured.
    """

    budget_bytes: int = 1 << 30
    pipeline_depth: int = 2
    timeout_s: float = 120.0
    trace: bool = False
    direct_min_bytes: int = DIRECT_MIN_BYTES
    bench: ExecutorBenchSwitches = field(default_factory=ExecutorBenchSwitches)

    def __post_init__(self) -> None:
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be at least 1, got {self.pipeline_depth}")
        if self.budget_bytes < ALIGN * self.pipeline_depth:
            raise ValueError(
                f"budget_bytes {self.budget_bytes} leaves less than {ALIGN} B per chunk at depth "
                f"{self.pipeline_depth}"
            )
        if self.direct_min_bytes < 1:
            raise ValueError(f"direct_min_bytes must be positive, got {self.direct_min_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> ExecutorConfig:
        """Defaults, then the environment, then explicit overrides."""
        env = os.environ if env is None else env
        try:
            values: dict[str, object] = {
                "budget_bytes": int(float(contract.P2P_BUDGET_MB.read(env)) * _MB),  # type: ignore[arg-type]
                "pipeline_depth": contract.P2P_PIPELINE_DEPTH.read(env),
                "direct_min_bytes": int(float(contract.P2P_DIRECT_MIN_MB.read(env)) * _MB),  # type: ignore[arg-type]
                "timeout_s": float(contract.P2P_TIMEOUT_S.read(env)),  # type: ignore[arg-type]
                "trace": contract.P2P_TRACE.read(env),
            }
        except contract.EnvError as exc:
            raise ValueError(f"bad p2p setting in the environment: {exc}") from None
        values.update(overrides)
        return ExecutorConfig(**values)  # type: ignore[arg-type]
