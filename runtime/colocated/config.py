"""Configuration of the colocated weight update, read once from the environment.

The operator injects these variables into both containers of a pod (trainer and SGLang). Required:

| variable | meaning |
|---|---|
| `COLOCATE_JOB_NAME` | the ColocateJob's name (part of every Redis key) |
| `COLOCATE_NAMESPACE` | the ColocateJob's namespace (part of every Redis key) |
| `COLOCATE_METASTORE_ADDR` | `host:port` of the job's Redis |
| `COLOCATE_METASTORE_PASSWORD` | Redis password, from the operator's Secret (`secretKeyRef`); never logged |

Optional, with defaults:

| variable | default | meaning |
|---|---|---|
| `COLOCATE_REPLICA_INDEX` | `0` | index of this pod in the job (0..numNodes-1) |
| `COLOCATE_BUCKET_MB` | `1024` | cap of one dtype-grouped bucket, MiB (a larger tensor gets its own) |
| `COLOCATE_STEP_TIMEOUT_SECONDS` | `300` | how long either side waits for its peer within one step |
| `COLOCATE_HEARTBEAT_TTL_SECONDS` | `10` | a peer whose heartbeat has not been seen for this long is dead |
| `COLOCATE_KEY_TTL_SECONDS` | `600` | TTL of every per-step key |
| `COLOCATE_VERIFY` | `None` | `None` or `SampledChecksum` (both sides checksum a few sampled entries) |
| `COLOCATE_TRANSPORT` | `CudaIPC` | `CudaIPC` (colocated), `SharedMemory` (CPU path, tests), `NCCL` (p2p) |
| `COLOCATE_SHM_DIR` | `/dev/shm` | directory of the shared-memory buckets (`SharedMemory` transport only) |
| `COLOCATE_ROLLOUT_PORT` | `30000` | SGLang's HTTP port in the same pod (the adapter calls 127.0.0.1) |
| `COLOCATE_SGLANG_URL` | from the port | SGLang's HTTP address, when it is not `http://127.0.0.1:PORT` |
| `COLOCATE_IPC_PREFLIGHT` | `Off` | `Wait`, `Fail` or `Off`: the IPC preflight (preflight.py), see below |
| `COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS` | `60` | one preflight attempt; no answer in it: `PeerTimeout` |
| `COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS` | `900` | `Wait` mode gives up (raises) after this long; `0`: never |

Set by the operator from `spec.rollout.apiKeySecretRef` (both containers): `SGLANG_API_KEY`, the key SGLang
runs with (`python -m colocate_runtime.sglang.serve` passes it as `--api-key` without a command line; or the
value of its `--admin-api-key` where one is set); the adapter sends it as a bearer token and never logs it.

The operator sets `COLOCATE_IPC_PREFLIGHT` from `spec.weightSync.ipcPreflight.mode` (default `Wait`); unset,
it is `Off`, because outside the operator's pods (tests, benchmarks) nothing may answer a preflight.

Everything else in the runtime takes a `ColocateConfig` (or a part of it); nothing below reads `os.environ`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TRANSPORTS = ("CudaIPC", "SharedMemory", "NCCL")
VERIFY_MODES = ("None", "SampledChecksum")
PREFLIGHT_MODES = ("Wait", "Fail", "Off")


class ConfigError(ValueError):
    """A variable is missing or malformed; the message names the variable, never a secret's value."""


@dataclass(frozen=True, slots=True)
class MetaStoreAddress:
    host: str
    port: int
    password: str = field(repr=False)

    def __str__(self) -> str:  # safe to log: no password
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ColocateConfig:
    job: str
    namespace: str
    metastore: MetaStoreAddress
    replica_index: int = 0
    bucket_bytes: int = 1024 << 20
    step_timeout_s: float = 300.0
    heartbeat_ttl_s: float = 10.0
    key_ttl_s: int = 600
    verify: str = "None"
    transport: str = "CudaIPC"
    shm_dir: str = "/dev/shm"
    sglang_url: str = "http://127.0.0.1:30000"
    sglang_api_key: str | None = field(default=None, repr=False)
    ipc_preflight: str = "Off"
    ipc_preflight_timeout_s: float = 60.0
    ipc_preflight_wait_s: float = 900.0  # bounded: a worker side that never starts is an error; 0: forever

    def __post_init__(self) -> None:
        for name, value in (("COLOCATE_JOB_NAME", self.job), ("COLOCATE_NAMESPACE", self.namespace)):
            if not value or any(c in value for c in ": \t\n{}"):
                raise ConfigError(f"{name}={value!r}: must be non-empty, without ':', braces or whitespace")
        if self.bucket_bytes <= 0:
            raise ConfigError("COLOCATE_BUCKET_MB must be positive")
        if self.step_timeout_s <= 0 or self.heartbeat_ttl_s <= 0 or self.key_ttl_s <= 0:
            raise ConfigError("timeouts and TTLs must be positive")
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
        if self.key_ttl_s < self.ipc_preflight_timeout_s:
            raise ConfigError(
                f"COLOCATE_KEY_TTL_SECONDS ({self.key_ttl_s}) must be at least "
                f"COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS ({self.ipc_preflight_timeout_s})"
            )

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> ColocateConfig:
        """Read and validate the variables above (pass `os.environ` at the process's edge)."""

        def required(name: str) -> str:
            value = environ.get(name, "").strip()
            if not value:
                raise ConfigError(f"{name} is not set (the operator injects it into both containers)")
            return value

        def number(name: str, default: float, kind: type = float) -> float:
            raw = environ.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None

        addr = required("COLOCATE_METASTORE_ADDR")
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"COLOCATE_METASTORE_ADDR={addr!r}: expected host:port")
        return ColocateConfig(
            job=required("COLOCATE_JOB_NAME"),
            namespace=required("COLOCATE_NAMESPACE"),
            metastore=MetaStoreAddress(host.strip("[]"), int(port), required("COLOCATE_METASTORE_PASSWORD")),
            replica_index=int(number("COLOCATE_REPLICA_INDEX", 0, int)),
            bucket_bytes=int(number("COLOCATE_BUCKET_MB", 1024, int)) << 20,
            step_timeout_s=number("COLOCATE_STEP_TIMEOUT_SECONDS", 300.0),
            heartbeat_ttl_s=number("COLOCATE_HEARTBEAT_TTL_SECONDS", 10.0),
            key_ttl_s=int(number("COLOCATE_KEY_TTL_SECONDS", 600, int)),
            verify=environ.get("COLOCATE_VERIFY", "").strip() or "None",
            transport=environ.get("COLOCATE_TRANSPORT", "").strip() or "CudaIPC",
            shm_dir=environ.get("COLOCATE_SHM_DIR", "").strip() or "/dev/shm",
            sglang_url=environ.get("COLOCATE_SGLANG_URL", "").strip()
            or f"http://127.0.0.1:{int(number('COLOCATE_ROLLOUT_PORT', 30000, int))}",
            sglang_api_key=environ.get("SGLANG_API_KEY", "").strip() or None,
            ipc_preflight=environ.get("COLOCATE_IPC_PREFLIGHT", "").strip() or "Off",
            ipc_preflight_timeout_s=number("COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS", 60.0),
            ipc_preflight_wait_s=number("COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS", 900.0),
        )
