"""Every `COLOCATE_*` variable in one table: name, type, default, meaning, who reads it, where it comes from.

The operator renders the worker pods' environment from it (`colocate_operator.pods`), the runtime parses with
it (`colocated.config.ColocateConfig.from_env`), and operator/README.md's tables are generated from it
(`python tools/env_readme.py --write operator/README.md`; a test fails when they differ). The
operator's own settings (its Deployment's environment, read by `colocate_operator.config`) are listed too, so
that one place holds every name; tests compare them with that module.

Readers: `runtime` (a module of this package, named in `read_by`), the user's trainer or rollout command
(injected for them, read by no runtime module), or the `operator`. Variables the operator does not inject can
be set only outside operator pods (tests, benchmarks, a process started by hand): the CRD reserves the
`COLOCATE_` prefix in a container's `env`, so inside an operator pod they keep their defaults.

Not listed: the development tools' own switches (`COLOCATE_BIN_DIR`, `COLOCATE_DEVCLUSTER_DIR`,
`COLOCATE_CACHE_DIR`, `COLOCATE_REDIS_SERVER`, `COLOCATE_BENCH_COMMIT`), which no deployed component reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

RUNTIME = "runtime"
TRAINER = "user's trainer"
ROLLOUT = "user's rollout command"
BOTH_USERS = "user's trainer and rollout command"
OPERATOR = "operator"


class EnvError(ValueError):
    """A variable is missing or malformed; the message names it, never a secret's value."""


@dataclass(frozen=True, slots=True)
class Var:
    """One variable. `default` is what a reader assumes when it is unset or blank (None: no default; then
    `required` says whether a reader refuses to start, and `default_doc` may describe a derived default).
    `source` is what the operator injects (a spec field, or how it is made); empty: not injected. Where the
    operator injects a different value than `default` when the spec leaves the field out,
    `operator_default` holds it (the CRD's default)."""

    name: str
    kind: type
    default: str | int | float | bool | None
    meaning: str
    read_by: str
    source: str = ""
    required: bool = False
    secret: bool = False
    choices: tuple[str, ...] = ()
    default_doc: str = ""
    operator_default: str | int | float | None = None

    @property
    def injected(self) -> bool:
        return bool(self.source)

    def raw(self, environ: Mapping[str, str]) -> str | None:
        """The stripped value, or None when unset or blank; a required variable's absence raises."""
        value = environ.get(self.name, "").strip()
        if value:
            return value
        if self.required:
            raise EnvError(f"{self.name} is not set (the operator injects it into both containers)")
        return None

    def read(self, environ: Mapping[str, str]) -> str | int | float | bool | None:
        """The typed value, or `default` when unset or blank."""
        raw = self.raw(environ)
        if raw is None:
            return self.default
        if self.kind is bool:
            if raw.lower() not in _TRUE | _FALSE:
                raise EnvError(f"{self.name}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
            return raw.lower() in _TRUE
        try:
            return self.kind(raw)
        except ValueError:
            shown = "(secret)" if self.secret else repr(raw)
            raise EnvError(f"{self.name}={shown} is not a {self.kind.__name__}") from None

    def render(self, value: object) -> dict[str, str]:
        """The pod env entry of a plain value (a secret is rendered by the pod builder as a secretKeyRef)."""
        if self.secret:
            raise EnvError(f"{self.name} is a secret: render it as a secretKeyRef, not a value")
        if isinstance(value, bool) and self.kind is not bool:
            raise EnvError(f"{self.name}: a {self.kind.__name__}, got a bool")
        if self.kind is bool:
            text = "true" if value else "false"
        elif self.kind in (int, float) and not isinstance(value, int | float):
            raise EnvError(f"{self.name}: a {self.kind.__name__}, got {type(value).__name__}")
        elif isinstance(value, float) and value.is_integer():
            text = str(int(value))  # 600, not 600.0: what the operator renders from the spec's integers
        else:
            text = str(value)
        return {"name": self.name, "value": text}

    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.default is None:
            return "required" if self.required else "unset"
        if self.kind is bool:
            return f"`{'true' if self.default else 'false'}`"
        return f"`{self.default}`"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_CONFIG = "runtime (`colocated/config.py`)"
_P2P = "runtime (`p2p/config.py`)"
_OPCONFIG = "operator (`colocate_operator/config.py`)"

# --- the pod contract: injected by the operator, read by the runtime ----------------------------------------
JOB_NAME = Var(
    "COLOCATE_JOB_NAME",
    str,
    None,
    "the ColocateJob's name (part of every Redis key)",
    _CONFIG,
    source="`metadata.name`",
    required=True,
)
NAMESPACE = Var(
    "COLOCATE_NAMESPACE",
    str,
    None,
    "the ColocateJob's namespace (part of every Redis key)",
    _CONFIG,
    source="`metadata.namespace`",
    required=True,
)
METASTORE_ADDR = Var(
    "COLOCATE_METASTORE_ADDR",
    str,
    None,
    "`host:port` of the job's Redis",
    _CONFIG,
    source="`<job>-metastore.<ns>.svc.<domain>:6379`, or `metaStore.external.address`",
    required=True,
)
METASTORE_USERNAME = Var(
    "COLOCATE_METASTORE_USERNAME",
    str,
    None,
    "the Redis user the pods authenticate as (ACL): limited to the job's keys, no admin command",
    _CONFIG,
    source="`colocate-worker` (Managed); External: key `username` of `metaStore.external.passwordSecretRef`'s"
    " Secret, where present (`secretKeyRef`, optional)",
    default_doc="unset: Redis's `default` user",
)
METASTORE_PASSWORD = Var(
    "COLOCATE_METASTORE_PASSWORD",
    str,
    None,
    "the password of `COLOCATE_METASTORE_USERNAME`; never logged",
    _CONFIG,
    source="`secretKeyRef`: `<job>-metastore-auth`/`worker-password`, or "
    "`metaStore.external.passwordSecretRef`",
    required=True,
    secret=True,
)
REPLICA_INDEX = Var(
    "COLOCATE_REPLICA_INDEX",
    int,
    0,
    "index of this pod in the job; the `replica` of its step events",
    _CONFIG,
    source="`0 .. numNodes-1`",
)
BUCKET_MB = Var(
    "COLOCATE_BUCKET_MB",
    int,
    1024,
    "cap of one dtype-grouped bucket, MiB (a larger tensor gets its own). 1024, not 512: the largest single "
    "tensor (a 150k-vocabulary embedding in bf16 is over 1 GiB) already sets the largest allocation, so a "
    "smaller cap only doubles the IPC handles",
    _CONFIG,
    source="`weightSync.bucketMB`",
)
STEP_TIMEOUT_SECONDS = Var(
    "COLOCATE_STEP_TIMEOUT_SECONDS",
    float,
    600,
    "how long either side waits for its peer within one step. 600, not 300: a dead peer is found by its "
    "heartbeat in seconds anyway, so this only bounds a live but slow one (SGLang draining requests before "
    "it pauses, a large model's first step), where waiting longer costs nothing",
    _CONFIG,
    source="`weightSync.stepTimeoutSeconds`",
)
TRANSPORT = Var(
    "COLOCATE_TRANSPORT",
    str,
    "CudaIPC",
    "`CudaIPC` (colocated), `NCCL` (p2p, runtime/p2p), `SharedMemory` (the CPU path: tests, the demo)",
    _CONFIG,
    source="`weightSync.transport`",
    choices=("CudaIPC", "SharedMemory", "NCCL"),
)
VERIFY = Var(
    "COLOCATE_VERIFY",
    str,
    "None",
    "`SampledChecksum`: both sides checksum a few sampled entries each step",
    _CONFIG,
    source="`weightSync.verify`",
    choices=("None", "SampledChecksum"),
)
IPC_PREFLIGHT = Var(
    "COLOCATE_IPC_PREFLIGHT",
    str,
    "Off",
    "the IPC preflight at start (`preflight.py`): `Wait`, `Fail` or `Off`. Unset it is `Off`, because "
    "outside the operator's pods (tests, benchmarks) nothing may answer a preflight; the operator's "
    "default is `Wait`",
    _CONFIG,
    source="`weightSync.ipcPreflight.mode`",
    choices=("Wait", "Fail", "Off"),
    operator_default="Wait",
)
IPC_PREFLIGHT_TIMEOUT_SECONDS = Var(
    "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS",
    float,
    60,
    "one preflight attempt; no answer in it: `PeerTimeout`",
    _CONFIG,
    source="`weightSync.ipcPreflight.timeoutSeconds`",
)
ROLLOUT_PORT = Var(
    "COLOCATE_ROLLOUT_PORT",
    int,
    30000,
    "SGLang's HTTP port in the same pod (the runtime's client calls 127.0.0.1); also for the user's rollout "
    "command (`--port`)",
    _CONFIG,
    source="`rollout.port`",
)
ROLLOUT_WEIGHTS = Var(
    "COLOCATE_ROLLOUT_WEIGHTS",
    str,
    "Auto",
    "how SGLang holds the weights: `Auto` (as its model config says), `BF16` (the model dtype) or "
    "`BlockFP8` (e4m3 with 128x128 block scales, quantized on the copy); a declared format the engine's "
    "config contradicts fails the first update with both named",
    _CONFIG,
    source="`weightSync.rolloutWeights`",
    choices=("Auto", "BF16", "BlockFP8"),
)
SGLANG_API_KEY = Var(
    "SGLANG_API_KEY",
    str,
    None,
    "the key SGLang runs with; the runtime's client sends it as a bearer token, never logs it",
    "runtime (`colocated/config.py`, `sglang/serve.py`)",
    source="`secretKeyRef` of `rollout.apiKeySecretRef`, only where set",
    secret=True,
)

# --- read by the runtime, never injected (the CRD reserves the prefix): for tests, benchmarks, hand runs ----
HEARTBEAT_TTL_SECONDS = Var(
    "COLOCATE_HEARTBEAT_TTL_SECONDS",
    float,
    10,
    "a peer whose heartbeat has not been seen for this long is dead",
    _CONFIG,
)
ACK_SPIN_MS = Var(
    "COLOCATE_ACK_SPIN_MS",
    float,
    20,
    "the trainer polls for a step's ACK this long before it blocks: a blocked process and an idle Redis "
    "server wake on cold cores, which costs about 0.5 ms of a 5 ms step. 0: block at once (no spinning core)",
    _CONFIG,
)
READY_SPIN_MS = Var(
    "COLOCATE_READY_SPIN_MS",
    float,
    20,
    "a reader that finds no step published polls for one this long before it blocks (the trainer's ACK "
    "spin, mirrored): a blocked reader wakes on a cold core. A reader called after the publish (SGLang's "
    "loader) finds the step at once and never spins. 0: block at once",
    _CONFIG,
)
WEIGHT_DIGEST_PERIOD = Var(
    "COLOCATE_WEIGHT_DIGEST_PERIOD",
    int,
    1024,
    "the weights check of every step (trainer side; the reader follows its manifest): both sides hash "
    "1/period of every parameter's bytes, a different part each step, so every byte is checked within "
    "this many steps; a mismatch fails the step naming the parameter (runtime/colocated/digest.py). 0: off",
    _CONFIG,
)
STEP_SUMMARY_GPUS = Var(
    "COLOCATE_STEP_SUMMARY_GPUS",
    int,
    0,
    "summary mode of the step-event stream (contract/events.py): a step's successful finishes are kept in "
    "the store until this many GPUs of the job have finished it, then one `completed` record is written, and "
    "progress phases come from replica 0, rank 0 only. 0: every GPU writes each of its records (detailed), "
    "as a runtime started by hand needs",
    _CONFIG,
    source="`numNodes` x `gpusPerNode`",
)
KEY_TTL_SECONDS = Var(
    "COLOCATE_KEY_TTL_SECONDS",
    int,
    None,
    "TTL of every per-step Redis key; at least the step and preflight timeouts. Derived, so that a "
    "`stepTimeoutSeconds` above 600 (the CRD allows up to 86400) does not leave pods refusing their config",
    _CONFIG,
    default_doc="twice the step timeout, at least `600`",
)
SHM_DIR = Var(
    "COLOCATE_SHM_DIR",
    str,
    "/dev/shm",
    "directory of the shared-memory buckets (`SharedMemory` only)",
    _CONFIG,
)
SGLANG_URL = Var(
    "COLOCATE_SGLANG_URL",
    str,
    None,
    "SGLang's HTTP address, when it is not on 127.0.0.1",
    _CONFIG,
    default_doc="`http://127.0.0.1:<COLOCATE_ROLLOUT_PORT>`",
)
DUMP_INSTALLED_DIR = Var(
    "COLOCATE_DUMP_INSTALLED_DIR",
    str,
    None,
    "a debugging aid: each SGLang TP worker saves what it installed after every step "
    "(`installed-step-S-rank-R.pt`: canonical name -> box, tensor) into this folder; unset: nothing saved",
    ROLLOUT,
)
IPC_PREFLIGHT_WAIT_SECONDS = Var(
    "COLOCATE_IPC_PREFLIGHT_WAIT_SECONDS",
    float,
    900,
    "`Wait` mode gives up (raises) after this long; `0`: never",
    _CONFIG,
)
P2P_BUDGET_MB = Var(
    "COLOCATE_P2P_BUDGET_MB",
    float,
    1024,
    "staging one rank of the p2p executor holds at once, MiB",
    _P2P,
)
P2P_PIPELINE_DEPTH = Var(
    "COLOCATE_P2P_PIPELINE_DEPTH",
    int,
    2,
    "p2p chunks in flight (2 overlaps packing with the wire)",
    _P2P,
)
P2P_TIMEOUT_S = Var(
    "COLOCATE_P2P_TIMEOUT_S",
    float,
    120,
    "longest wait for one p2p peer batch before the run fails",
    _P2P,
)
P2P_TRACE = Var(
    "COLOCATE_P2P_TRACE",
    bool,
    False,
    "log when each p2p peer batch is enqueued and drained",
    _P2P,
)
P2P_DIRECT_MIN_MB = Var(
    "COLOCATE_P2P_DIRECT_MIN_MB",
    float,
    4,
    "p2p slices at least this big travel as their own message, MiB",
    _P2P,
)

# --- injected for the user's trainer and rollout command: no runtime module reads them ----------------------
NUM_NODES = Var(
    "COLOCATE_NUM_NODES",
    int,
    None,
    "pods in the job (the trainer's `torch.distributed` world: nodes)",
    TRAINER,
    source="`numNodes`",
)
GPUS_PER_NODE = Var(
    "COLOCATE_GPUS_PER_NODE",
    int,
    None,
    "GPUs of each pod (processes per pod)",
    BOTH_USERS,
    source="`gpusPerNode`",
)
RENDEZVOUS_ADDR = Var(
    "COLOCATE_RENDEZVOUS_ADDR",
    str,
    None,
    "`host:port` of pod 0's trainer: `MASTER_ADDR`/`MASTER_PORT` of `torch.distributed`",
    TRAINER,
    source="`<job>-0.<job>.<ns>.svc.<domain>:<trainer.port>` (pod 0 via the headless Service)",
)
TRAIN_TP = Var(
    "COLOCATE_TRAIN_TP", int, 1, "Megatron tensor parallelism", TRAINER, source="`parallelism.train.tensor`"
)
TRAIN_PP = Var(
    "COLOCATE_TRAIN_PP",
    int,
    1,
    "Megatron pipeline parallelism",
    TRAINER,
    source="`parallelism.train.pipeline`",
)
TRAIN_EP = Var(
    "COLOCATE_TRAIN_EP", int, 1, "Megatron expert parallelism", TRAINER, source="`parallelism.train.expert`"
)
TRAIN_CP = Var(
    "COLOCATE_TRAIN_CP", int, 1, "Megatron context parallelism", TRAINER, source="`parallelism.train.context`"
)
INFER_TP = Var(
    "COLOCATE_INFER_TP", int, 1, "SGLang `--tp-size`", ROLLOUT, source="`parallelism.inference.tensor`"
)
INFER_DP = Var(
    "COLOCATE_INFER_DP", int, 1, "SGLang `--dp-size`", ROLLOUT, source="`parallelism.inference.data`"
)
INFER_EP = Var(
    "COLOCATE_INFER_EP", int, 1, "SGLang `--ep-size`", ROLLOUT, source="`parallelism.inference.expert`"
)
MODEL_ARCH = Var(
    "COLOCATE_MODEL_ARCH",
    str,
    None,
    "the converter family (`runtime/convert`) the trainer builds",
    TRAINER,
    source="`model.arch`",
    choices=("qwen3", "qwen3_moe", "deepseek_v3", "bailing_moe"),
)
MODEL_CONFIG = Var(
    "COLOCATE_MODEL_CONFIG",
    str,
    None,
    "the Hugging Face config reference both sides load",
    BOTH_USERS,
    source="`model.config`, only where set",
)
CONTAINER = Var(
    "COLOCATE_CONTAINER",
    str,
    None,
    "which container this is, for an entrypoint shared by both",
    BOTH_USERS,
    source="`trainer` or `rollout`",
    choices=("trainer", "rollout"),
)
RESTART_COUNT = Var(
    "COLOCATE_RESTART_COUNT",
    int,
    0,
    "the group's incarnation (`status.restarts` when the pod was made): a trainer resumes from its "
    "checkpoint when it is above 0",
    TRAINER,
    source="`status.restarts`",
)
SOCKET_DIR = Var(
    "COLOCATE_SOCKET_DIR",
    str,
    "/run/colocate",
    "an empty directory mounted in both containers, for the user's Unix sockets between them",
    BOTH_USERS,
    source="`/run/colocate`",
)

# --- the operator's own Deployment (the chart sets them) ----------------------------------------------------
RECONCILE_INTERVAL_SECONDS = Var(
    "COLOCATE_RECONCILE_INTERVAL_SECONDS",
    float,
    120,
    "period of the resync pass over every job; children seen are trusted this long",
    _OPCONFIG,
)
RECONCILE_WORKERS = Var(
    "COLOCATE_RECONCILE_WORKERS", int, 4, "threads running reconcile passes (1-64)", _OPCONFIG
)
CLUSTER_DOMAIN = Var(
    "COLOCATE_CLUSTER_DOMAIN",
    str,
    "cluster.local",
    "DNS domain in the addresses handed to the pods",
    _OPCONFIG,
)
OPERATOR_NAMESPACE = Var(
    "COLOCATE_OPERATOR_NAMESPACE",
    str,
    None,
    "namespace the operator runs in; the meta-store NetworkPolicy admits it",
    _OPCONFIG,
)
OPERATOR_POD_LABELS = Var(
    "COLOCATE_OPERATOR_POD_LABELS",
    str,
    "app.kubernetes.io/name=colocate-operator",
    "the operator pod's labels, `k=v,...`",
    _OPCONFIG,
)
MAX_BACKOFF_SECONDS = Var(
    "COLOCATE_MAX_BACKOFF_SECONDS",
    float,
    300,
    "cap of the restart backoff (a larger `backoffSeconds` is capped, and the conditions say so)",
    _OPCONFIG,
)
FORCE_DELETE_AFTER_SECONDS = Var(
    "COLOCATE_FORCE_DELETE_AFTER_SECONDS",
    float,
    120,
    "a pod still Terminating this long after its grace period (its node does not answer) is deleted with "
    "grace period 0",
    _OPCONFIG,
)
EXTERNAL_METASTORE_ALLOW = Var(
    "COLOCATE_EXTERNAL_METASTORE_ALLOW",
    str,
    None,
    "External meta-store addresses the operator may dial, comma-separated (below)",
    _OPCONFIG,
    default_doc="unset (none)",
)
CREATE_DELAY_SECONDS = Var(
    "COLOCATE_CREATE_DELAY_SECONDS",
    float,
    0,
    "fault injection for tests only: pause before each pod creation",
    _OPCONFIG,
)

POD = (
    JOB_NAME,
    NAMESPACE,
    REPLICA_INDEX,
    METASTORE_ADDR,
    METASTORE_USERNAME,
    METASTORE_PASSWORD,
    BUCKET_MB,
    STEP_TIMEOUT_SECONDS,
    TRANSPORT,
    VERIFY,
    ROLLOUT_WEIGHTS,
    IPC_PREFLIGHT,
    IPC_PREFLIGHT_TIMEOUT_SECONDS,
    ROLLOUT_PORT,
    SGLANG_API_KEY,
    NUM_NODES,
    GPUS_PER_NODE,
    RENDEZVOUS_ADDR,
    TRAIN_TP,
    TRAIN_PP,
    TRAIN_EP,
    TRAIN_CP,
    INFER_TP,
    INFER_DP,
    INFER_EP,
    MODEL_ARCH,
    MODEL_CONFIG,
    CONTAINER,
    RESTART_COUNT,
    SOCKET_DIR,
    HEARTBEAT_TTL_SECONDS,
    ACK_SPIN_MS,
    READY_SPIN_MS,
    WEIGHT_DIGEST_PERIOD,
    STEP_SUMMARY_GPUS,
    KEY_TTL_SECONDS,
    SHM_DIR,
    SGLANG_URL,
    DUMP_INSTALLED_DIR,
    IPC_PREFLIGHT_WAIT_SECONDS,
    P2P_BUDGET_MB,
    P2P_PIPELINE_DEPTH,
    P2P_TIMEOUT_S,
    P2P_TRACE,
    P2P_DIRECT_MIN_MB,
)
"""Every variable of a worker pod's containers: injected ones first, then the runtime's unset-by-default."""
OPERATOR_SETTINGS = (
    RECONCILE_INTERVAL_SECONDS,
    RECONCILE_WORKERS,
    CLUSTER_DOMAIN,
    OPERATOR_NAMESPACE,
    OPERATOR_POD_LABELS,
    MAX_BACKOFF_SECONDS,
    FORCE_DELETE_AFTER_SECONDS,
    EXTERNAL_METASTORE_ALLOW,
    CREATE_DELAY_SECONDS,
)
TABLE = POD + OPERATOR_SETTINGS
BY_NAME = {var.name: var for var in TABLE}
if len(BY_NAME) != len(TABLE):
    raise RuntimeError("a variable is listed twice in the table")
