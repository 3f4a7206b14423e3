"""The ColocateJob spec, read once at the edge into frozen models and passed down.

The API server already validated the spec and applied the CRD's defaults; the defaults below repeat the
CRD's (a unit test compares the two) so that builders can be tested from minimal specs without a cluster.
Unknown fields are ignored: the CRD's structural schema prunes them anyway.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from colocate_operator.constants import CONTAINER_ROLLOUT, CONTAINER_TRAINER, REDIS_IMAGE


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ComputeDomainRef(_Model):
    """A ComputeDomain's channel (NVIDIA's DRA driver): the ResourceClaimTemplate its controller made."""

    resource_claim_template_name: str


class GpuSpec(_Model):
    allocation: Literal["DRA", "DevicePlugin"] = "DRA"
    device_class_name: str = "gpu.nvidia.com"
    selectors: tuple[str, ...] = ()
    resource_name: str = "nvidia.com/gpu"
    compute_domain: ComputeDomainRef | None = None


class ModelSpec(_Model):
    arch: Literal["qwen3", "qwen3_moe", "deepseek_v3", "bailing_moe"]
    config: str | None = None


class TrainParallelism(_Model):
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1


class InferenceParallelism(_Model):
    tensor: int = 1
    data: int = 1
    expert: int = 1


class ParallelismSpec(_Model):
    train: TrainParallelism = TrainParallelism()
    inference: InferenceParallelism = InferenceParallelism()


class SecretRef(_Model):
    """A key of a Secret in the job's namespace, both parts required."""

    name: str
    key: str


class ContainerSpec(_Model):
    image: str
    image_pull_policy: str | None = None
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    # Env entries and resources stay in their Kubernetes (camelCase) shape: they go into the pod verbatim.
    env: tuple[dict[str, Any], ...] = ()
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    port: int | None = None
    # Kubernetes shape, laid over the operator's defaults key by key (pods.py).
    security_context: dict[str, Any] = Field(default_factory=dict)
    api_key_secret_ref: SecretRef | None = None  # rollout only (a CRD rule)


class IpcPreflightSpec(_Model):
    mode: Literal["Wait", "Fail", "Off"] = "Wait"
    timeout_seconds: int = 60


class RolloutConsistencySpec(_Model):
    """When the engine's log-probs of its sampled tokens drift from the trainer's (the trainer's `rollout`
    events, runtime/consistency.py): a step breaches when its K3 KL is over `kl_threshold`, or over
    `baseline_factor` x the rolling baseline (the mean KL of the last `baseline_steps` healthy steps, once
    `baseline_min_steps` of them exist) and over `baseline_floor` (differences in the last digits of tiny KLs
    are noise, not drift)."""

    kl_threshold: float = 0.01
    baseline_factor: float = 2.0
    baseline_steps: int = 50
    baseline_min_steps: int = 10
    baseline_floor: float = 0.001
    action: Literal["Report", "SuspendAtStepBoundary", "Fail"] = "Report"


class WeightSyncSpec(_Model):
    transport: Literal["CudaIPC"] = "CudaIPC"
    bucket_mb: int = Field(1024, alias="bucketMB")
    step_timeout_seconds: int = 600
    progress_deadline_seconds: int = 3600
    verify: Literal["None", "SampledChecksum"] = "None"
    rollout_weights: Literal["Auto", "BF16", "BlockFP8"] = "Auto"
    history_limit: int = 10
    ipc_preflight: IpcPreflightSpec = IpcPreflightSpec()
    rollout_consistency: RolloutConsistencySpec = RolloutConsistencySpec()


class SecretKeyRef(_Model):
    name: str
    key: str = "password"


class ExternalMetaStore(_Model):
    address: str
    password_secret_ref: SecretKeyRef


class MetaStoreSpec(_Model):
    mode: Literal["Managed", "External"] = "Managed"
    image: str = REDIS_IMAGE
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    external: ExternalMetaStore | None = None


class PodSpec(_Model):
    shm_size: str = "16Gi"
    termination_grace_period_seconds: int = 30
    service_account_name: str | None = None
    automount_service_account_token: bool = False
    allow_privileged: bool = False  # the job's opt-in past the CRD's rules; the operator's config decides
    security_context: dict[str, Any] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RunPolicy(_Model):
    max_restarts: int = 3
    # SGLang's in-place restarts a group incarnation may use (over all its pods) before the group restarts.
    max_engine_restarts: int = 5
    backoff_seconds: int = 10
    suspend_grace_period_seconds: int = 60
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None


class TopologySpec(_Model):
    """Kueue topology-aware scheduling: a node label key naming a level (rack, block, NVLink clique).
    At most one is set (a CRD rule)."""

    required: str | None = None
    preferred: str | None = None


class SchedulingSpec(_Model):
    queue_name: str | None = None
    topology: TopologySpec = TopologySpec()
    priority_class_name: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    placement_timeout_seconds: int = 300


class ColocateJobSpec(_Model):
    suspend: bool = False
    num_nodes: int
    gpus_per_node: int
    gpu: GpuSpec = GpuSpec()
    model: ModelSpec
    parallelism: ParallelismSpec = ParallelismSpec()
    trainer: ContainerSpec
    rollout: ContainerSpec
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    meta_store: MetaStoreSpec = MetaStoreSpec()
    pod: PodSpec = PodSpec()
    run_policy: RunPolicy = RunPolicy()
    scheduling: SchedulingSpec = SchedulingSpec()

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def container(self, role: str) -> ContainerSpec:
        return {CONTAINER_TRAINER: self.trainer, CONTAINER_ROLLOUT: self.rollout}[role]


DEFAULT_PORTS = {CONTAINER_TRAINER: 29500, CONTAINER_ROLLOUT: 30000}


class JobRef(_Model):
    """Identity of one ColocateJob: what every child's name, labels and ownerReference derive from."""

    name: str
    namespace: str
    uid: str
    generation: int = 0


class ColocateJob(_Model):
    ref: JobRef
    spec: ColocateJobSpec
    # The job's own labels: Kueue's queue-name and priority-class labels go here, as on Kueue's own jobs.
    labels: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ColocateJob:
        meta = body["metadata"]
        ref = JobRef(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
        )
        return cls(
            ref=ref,
            spec=ColocateJobSpec.model_validate(body.get("spec") or {}),
            labels=dict(meta.get("labels") or {}),
        )
