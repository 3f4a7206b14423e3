"""The writer's settings: the table's defaults (contract/env.py), or a `ColocateConfig`'s values."""

from __future__ import annotations

from dataclasses import dataclass, field

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.preflight import PreflightSettings
from colocate_runtime.contract import env
from colocate_runtime.contract.events import TERMINATION_LOG


@dataclass(frozen=True, slots=True)
class WriterSettings:
    job: str
    namespace: str
    replica: int = 0
    rank: int = 0
    # The table's defaults (contract/env.py), as a ColocateConfig's.
    bucket_bytes: int = env.BUCKET_MB.default << 20
    step_timeout_s: float = float(env.STEP_TIMEOUT_SECONDS.default)
    heartbeat_ttl_s: float = float(env.HEARTBEAT_TTL_SECONDS.default)
    checksum_entries: int = 0  # > 0: sampled checksums of that many entries per step
    # The weights check of every step (digest.py): every byte sampled within this many steps; 0: off.
    digest_period: int = env.WEIGHT_DIGEST_PERIOD.default
    keep_steps: int = 2  # a step's keys are deleted once this many newer steps finished
    ack_spin_s: float = env.ACK_SPIN_MS.default / 1e3  # poll for the ACK this long first (ClaimantAcks.spin)
    preflight: PreflightSettings = field(default_factory=PreflightSettings)  # Off unless configured
    termination_log: str | None = None  # `finish` also leaves the final record there if it exists

    @staticmethod
    def from_config(cfg: ColocateConfig, *, rank: int = 0, checksum_entries: int = 8) -> WriterSettings:
        return WriterSettings(
            job=cfg.job,
            namespace=cfg.namespace,
            replica=cfg.replica_index,
            rank=rank,
            bucket_bytes=cfg.bucket_bytes,
            step_timeout_s=cfg.step_timeout_s,
            heartbeat_ttl_s=cfg.heartbeat_ttl_s,
            ack_spin_s=cfg.ack_spin_ms / 1e3,
            checksum_entries=checksum_entries if cfg.verify == "SampledChecksum" else 0,
            digest_period=cfg.weight_digest_period,
            preflight=PreflightSettings.from_config(cfg),
            termination_log=TERMINATION_LOG,
        )
