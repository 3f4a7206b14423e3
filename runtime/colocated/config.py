"""Configuration of the colocated weight update, read once from the environment.

The variables, their types, defaults and meanings are the contract's table (`colocate_runtime.contract.env`,
rendered in operator/README.md, "Pod environment contract"); `ColocateConfig.from_env` reads each through it,
so a name or default is written once. The operator injects the job's into both containers of a pod; the rest
keep their defaults there (the CRD reserves the `COLOCATE_` prefix) and are set only outside operator pods.

`SGLANG_API_KEY` (from `spec.rollout.apiKeySecretRef`, both containers) is the key SGLang runs with
(`python -m colocate_runtime.sglang.serve` passes it as `--api-key`; or the value of its `--admin-api-key`
where one is set); the adapter sends it as a bearer token and never logs it.

Everything else in the runtime takes a `ColocateConfig` (or a part of it); nothing below reads `os.environ`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from colocate_runtime.contract import env

TRANSPORTS = env.TRANSPORT.choices
VERIFY_MODES = env.VERIFY.choices
ROLLOUT_WEIGHTS = env.ROLLOUT_WEIGHTS.choices
PREFLIGHT_MODES = env.IPC_PREFLIGHT.choices
# A step's keys outlive its slowest side by a whole step timeout; never below the shortest TTL used before.
KEY_TTL_MIN_S = 600


def default_key_ttl(step_timeout_s: float) -> int:
    """`COLOCATE_KEY_TTL_SECONDS` when unset: twice the step timeout, at least KEY_TTL_MIN_S."""
    return max(KEY_TTL_MIN_S, math.ceil(2 * step_timeout_s))


class ConfigError(ValueError):
    """A variable is missing or malformed; the message names the variable, never a secret's value."""


@dataclass(frozen=True, slots=True)
class MetaStoreAddress:
    host: str
    port: int
    password: str = field(repr=False)
    # The Redis (ACL) user; None: `default`. The operator's pods get one limited to the job's keys.
    username: str | None = None

    def __str__(self) -> str:  # safe to log: no password
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ColocateConfig:
    job: str
    namespace: str
    metastore: MetaStoreAddress
    # The defaults are the table's (contract/env.py), so a config built in code agrees with one read.
    replica_index: int = env.REPLICA_INDEX.default
    bucket_bytes: int = env.BUCKET_MB.default << 20
    step_timeout_s: float = float(env.STEP_TIMEOUT_SECONDS.default)
    heartbeat_ttl_s: float = float(env.HEARTBEAT_TTL_SECONDS.default)
    ack_spin_ms: float = float(env.ACK_SPIN_MS.default)
    ready_spin_ms: float = float(env.READY_SPIN_MS.default)
    key_ttl_s: int = default_key_ttl(float(env.STEP_TIMEOUT_SECONDS.default))
    verify: str = env.VERIFY.default
    transport: str = env.TRANSPORT.default
    shm_dir: str = env.SHM_DIR.default
    sglang_url: str = f"http://127.0.0.1:{env.ROLLOUT_PORT.default}"
    sglang_api_key: str | None = field(default=None, repr=False)
    ipc_preflight: str = env.IPC_PREFLIGHT.default
    ipc_preflight_timeout_s: float = float(env.IPC_PREFLIGHT_TIMEOUT_SECONDS.default)
    # Bounded: a worker side that never starts is an error; 0: forever.
    ipc_preflight_wait_s: float = float(env.IPC_PREFLIGHT_WAIT_SECONDS.default)
    weight_digest_period: int = env.WEIGHT_DIGEST_PERIOD.default  # 0: no weights check (digest.py)
    rollout_weights: str = env.ROLLOUT_WEIGHTS.default  # Auto | BF16 | BlockFP8 (sglang/auto.py)
    step_summary_gpus: int = env.STEP_SUMMARY_GPUS.default  # 0: detailed step events (step_summary.py)

    def __post_init__(self) -> None:
        for name, value in (("COLOCATE_JOB_NAME", self.job), ("COLOCATE_NAMESPACE", self.namespace)):
            if not value or any(c in value for c in ": \t\n{}"):
                raise ConfigError(f"{name}={value!r}: must be non-empty, without ':', braces or whitespace")
        if self.bucket_bytes <= 0:
            raise ConfigError("COLOCATE_BUCKET_MB must be positive")
        if self.step_timeout_s <= 0 or self.heartbeat_ttl_s <= 0 or self.key_ttl_s <= 0:
            raise ConfigError("timeouts and TTLs must be positive")
        for spin, value in ((env.ACK_SPIN_MS, self.ack_spin_ms), (env.READY_SPIN_MS, self.ready_spin_ms)):
            if not 0 <= value <= 1000:
                raise ConfigError(f"{spin.name}={value}: expected 0 to 1000")
        if self.key_ttl_s < self.step_timeout_s:
            raise ConfigError(
                f"COLOCATE_KEY_TTL_SECONDS ({self.key_ttl_s}) must be at least COLOCATE_STEP_TIMEOUT_SECONDS "
                f"({self.step_timeout_s}): a step's keys must outlive the step"
            )
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"COLOCATE_VERIFY={self.verify!r}: expected one of {VERIFY_MODES}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"COLOCATE_TRANSPORT={self.transport!r}: expected one of {TRANSPORTS}")
        if self.ipc_preflight not in PREFLIGHT_MODES:
            raise ConfigError(
                f"COLOCATE_IPC_PREFLIGHT={self.ipc_preflight!r}: expected one of {PREFLIGHT_MODES}"
            )
        if self.ipc_preflight_timeout_s <= 0 or self.ipc_preflight_wait_s < 0:
            raise ConfigError(
                "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS must be positive and "
                "COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS not negative"
            )
        if not 0 <= self.step_summary_gpus <= 1 << 16:
            raise ConfigError(
                f"{env.STEP_SUMMARY_GPUS.name}={self.step_summary_gpus}: expected 0 (detailed) to {1 << 16}"
            )
        if not 0 <= self.weight_digest_period <= 1 << 20:
            raise ConfigError(
                f"{env.WEIGHT_DIGEST_PERIOD.name}={self.weight_digest_period}: expected 0 (off) to {1 << 20}"
            )
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            raise ConfigError(
                f"{env.ROLLOUT_WEIGHTS.name}={self.rollout_weights!r}: expected one of {ROLLOUT_WEIGHTS}"
            )
        if self.key_ttl_s < self.ipc_preflight_timeout_s:
            raise ConfigError(
                f"COLOCATE_KEY_TTL_SECONDS ({self.key_ttl_s}) must be at least "
                f"COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS ({self.ipc_preflight_timeout_s})"
            )

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> ColocateConfig:
        """Read and validate the variables of the table (pass `os.environ` at the process's edge)."""
        try:
            return ColocateConfig._from_env(environ)
        except env.EnvError as err:
            raise ConfigError(str(err)) from None

    @staticmethod
    def _from_env(environ: Mapping[str, str]) -> ColocateConfig:
        def read(var: env.Var) -> Any:
            return var.read(environ)

        addr = read(env.METASTORE_ADDR)
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{env.METASTORE_ADDR.name}={addr!r}: expected host:port")
        step_timeout_s = float(read(env.STEP_TIMEOUT_SECONDS))
        key_ttl_s = read(env.KEY_TTL_SECONDS)
        return ColocateConfig(
            job=read(env.JOB_NAME),
            namespace=read(env.NAMESPACE),
            metastore=MetaStoreAddress(
                host.strip("[]"),
                int(port),
                read(env.METASTORE_PASSWORD),
                read(env.METASTORE_USERNAME),
            ),
            replica_index=read(env.REPLICA_INDEX),
            bucket_bytes=read(env.BUCKET_MB) << 20,
            step_timeout_s=step_timeout_s,
            heartbeat_ttl_s=float(read(env.HEARTBEAT_TTL_SECONDS)),
            ack_spin_ms=float(read(env.ACK_SPIN_MS)),
            ready_spin_ms=float(read(env.READY_SPIN_MS)),
            key_ttl_s=default_key_ttl(step_timeout_s) if key_ttl_s is None else key_ttl_s,
            verify=read(env.VERIFY),
            transport=read(env.TRANSPORT),
            shm_dir=read(env.SHM_DIR),
            sglang_url=read(env.SGLANG_URL) or f"http://127.0.0.1:{read(env.ROLLOUT_PORT)}",
            sglang_api_key=read(env.SGLANG_API_KEY),
            ipc_preflight=read(env.IPC_PREFLIGHT),
            ipc_preflight_timeout_s=float(read(env.IPC_PREFLIGHT_TIMEOUT_SECONDS)),
            ipc_preflight_wait_s=float(read(env.IPC_PREFLIGHT_WAIT_SECONDS)),
            weight_digest_period=read(env.WEIGHT_DIGEST_PERIOD),
            rollout_weights=read(env.ROLLOUT_WEIGHTS),
            step_summary_gpus=read(env.STEP_SUMMARY_GPUS),
        )
