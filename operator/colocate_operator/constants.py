"""Names the API, the children and the status share: one place, so a rename cannot drift.

Nothing here talks to Kubernetes; every other module may import it.
"""

from __future__ import annotations

from typing import Final

# The custom resource.
GROUP: Final = "colocate.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "ColocateJob"
PLURAL: Final = "colocatejobs"
SHORT_NAME: Final = "cjob"  # "cj" belongs to CronJob
OPERATOR_NAME: Final = "colocate-operator"

# Labels on every child. Selectors use LABEL_JOB plus LABEL_COMPONENT; nothing selects on user labels.
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_COMPONENT: Final = f"{GROUP}/component"
LABEL_REPLICA_INDEX: Final = f"{GROUP}/replica-index"
LABEL_RESTART: Final = f"{GROUP}/restart"  # the group incarnation a pod belongs to (= status.restarts)
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
COMPONENT_WORKER: Final = "worker"
COMPONENT_METASTORE: Final = "metastore"

# Kueue's queue label: on a job it names the LocalQueue the job's Workload waits in (kueue.py).
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
# Kueue topology-aware scheduling: all pods of the pod set in one domain of this level (or preferably so).
KUEUE_REQUIRED_TOPOLOGY_ANNOTATION: Final = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY_ANNOTATION: Final = "kueue.x-k8s.io/podset-preferred-topology"

# The pod.
CONTAINER_TRAINER: Final = "trainer"
CONTAINER_ROLLOUT: Final = "rollout"
CLAIM_NAME: Final = "gpus"  # the pod-level claim both containers reference
COMPUTE_DOMAIN_CLAIM_NAME: Final = "compute-domain"  # the ComputeDomain channel's claim, in both too
SHM_VOLUME: Final = "dshm"
SHM_MOUNT_PATH: Final = "/dev/shm"
SOCKET_VOLUME: Final = "colocate-sockets"
SOCKET_MOUNT_PATH: Final = "/run/colocate"
GPU_TAINT_KEY: Final = "nvidia.com/gpu"

# The managed meta-store.
REDIS_PORT: Final = 6379
SECRET_PASSWORD_KEY: Final = "password"  # the operator's (Redis user `default`)
SECRET_WORKER_PASSWORD_KEY: Final = "worker-password"  # the job's pods' (WORKER_REDIS_USER)
WORKER_REDIS_USER: Final = "colocate-worker"
# External: the optional key of the job's password Secret naming the Redis user of that password.
SECRET_USERNAME_KEY: Final = "username"
SECRET_CONFIG_KEY: Final = "redis.conf"
# What a Managed Secret holds, on its metadata (read without its data): "2" has the pods' worker user. A
# Secret without it predates that user: the operator says so in an Event (reconciler._read_children).
SECRET_FORMAT_ANNOTATION: Final = f"{GROUP}/secret-format"
SECRET_FORMAT: Final = "2"
REDIS_CONFIG_MOUNT: Final = "/etc/colocate-redis"
# Patched Redis (7.4.6 fixed the Lua RCE CVE-2025-49844, which no ACL can block: the protocol needs EVAL),
# pinned by the digest of the official multi-platform image (operator/README.md says where it comes from).
REDIS_IMAGE: Final = (
    "redis:7.4.8-alpine@sha256:7aec734b2bb298a1d769fd8729f13b8514a41bf90fcdd1f38ec52267fbaa8ee6"
)

# kopf keeps its handler progress in annotations under this prefix (never in status: see the CRD).
KOPF_PREFIX: Final = GROUP


class Phase:
    """status.phase: for printer columns and humans; decisions read conditions and counters."""

    PENDING: Final = "Pending"
    RUNNING: Final = "Running"
    RESTARTING: Final = "Restarting"
    SUSPENDING: Final = "Suspending"  # suspend asked: the sync in flight and the checkpoint may finish
    SUSPENDED: Final = "Suspended"
    SUCCEEDED: Final = "Succeeded"
    FAILED: Final = "Failed"

    TERMINAL: Final = frozenset({SUCCEEDED, FAILED})
    ALL: Final = (PENDING, RUNNING, RESTARTING, SUSPENDING, SUSPENDED, SUCCEEDED, FAILED)


class Cond:
    """The fixed set of condition types. Never one type per step or per pod."""

    META_STORE_READY: Final = "MetaStoreReady"
    RESOURCES_ALLOCATED: Final = "ResourcesAllocated"
    PODS_READY: Final = "PodsReady"
    SUSPENDED: Final = "Suspended"
    RESTARTING: Final = "Restarting"
    SUCCEEDED: Final = "Succeeded"
    FAILED: Final = "Failed"
    # Only once SGLang restarted in place (its container alone; the trainer kept running): True when it serves
    # again, False (EngineRestarting) while it comes back.
    ENGINE_RECOVERED: Final = "EngineRecovered"
    # Written by the step-event consumer (weight-sync issue), never by the reconciler:
    WEIGHT_SYNC_HEALTHY: Final = "WeightSyncHealthy"
    PROGRESSING: Final = "Progressing"
    IPC_READY: Final = "IPCReady"  # every GPU passed the runtime's IPC preflight
    # Only once the trainer reported a rollout comparison (Publisher.report_rollout): its last step's KL
    # within spec.weightSync.rolloutConsistency.
    ROLLOUT_CONSISTENT: Final = "RolloutConsistent"
    ADMITTED: Final = "Admitted"  # only on a job Kueue queues (kueue.py): its Workload is admitted

    RECONCILED: Final = (
        META_STORE_READY,
        RESOURCES_ALLOCATED,
        PODS_READY,
        SUSPENDED,
        RESTARTING,
        ENGINE_RECOVERED,
        SUCCEEDED,
        FAILED,
        ADMITTED,
    )
    ALL: Final = (*RECONCILED, WEIGHT_SYNC_HEALTHY, PROGRESSING, IPC_READY, ROLLOUT_CONSISTENT)


class Reason:
    """CamelCase condition reasons and Event reasons: a stable API, so they are listed, not composed."""

    # MetaStoreReady
    REDIS_READY: Final = "RedisReady"
    REDIS_STARTING: Final = "RedisStarting"
    EXTERNAL_CONFIGURED: Final = "ExternalConfigured"
    SECRET_NOT_FOUND: Final = "SecretNotFound"
    EXTERNAL_ADDRESS_NOT_ALLOWED: Final = "ExternalAddressNotAllowed"
    NAME_TAKEN: Final = "NameTaken"  # a child's name is held by an object not the job's (also PodsReady)
    # ResourcesAllocated
    CLAIMS_ALLOCATED: Final = "ClaimsAllocated"
    CLAIM_PENDING: Final = "ClaimPending"
    DEVICE_CLASS_NOT_FOUND: Final = "DeviceClassNotFound"
    DEVICE_PLUGIN_FALLBACK: Final = "DevicePluginFallback"
    WAITING_FOR_SCHEDULING: Final = "WaitingForScheduling"
    UNSCHEDULABLE: Final = "Unschedulable"  # the message carries the scheduler's reason
    NO_PODS: Final = "NoPods"
    # PodsReady
    ALL_PODS_READY: Final = "AllPodsReady"
    PODS_PENDING: Final = "PodsPending"
    PODS_NOT_CREATED: Final = "PodsNotCreated"
    WAITING_FOR_BACKOFF: Final = "WaitingForBackoff"
    WAITING_FOR_OLD_PODS: Final = "WaitingForOldPods"
    WAITING_FOR_FINAL_RECORD: Final = "WaitingForFinalRecord"  # a pod exited; did the trainer finish?
    CREATE_REFUSED: Final = "CreateRefused"  # the API server refused a pod (quota, policy): backing off
    # Admitted (a job with a Kueue queue; the message carries Kueue's own words)
    QUEUED_BY_KUEUE: Final = "QueuedByKueue"  # waiting for quota: no pods
    ADMITTED_BY_KUEUE: Final = "AdmittedByKueue"
    EVICTED_BY_KUEUE: Final = "EvictedByKueue"  # also Suspended's reason: Kueue took the quota back
    # Suspended
    SUSPENDED_BY_USER: Final = "SuspendedByUser"
    NOT_SUSPENDED: Final = "NotSuspended"
    WAITING_FOR_CHECKPOINT: Final = "WaitingForCheckpoint"  # False while the pods finish the step
    # Restarting (True while a whole-group restart is in progress)
    POD_FAILED: Final = "PodFailed"
    POD_DELETED: Final = "PodDeleted"
    POD_EVICTED: Final = "PodEvicted"
    POD_EXITED_WITHOUT_FINAL_STEP: Final = "PodExitedWithoutFinalStep"
    PLACEMENT_TIMEOUT: Final = "PlacementTimeout"  # a partly placed group released its GPUs
    META_STORE_PASSWORD_CHANGED: Final = "MetaStorePasswordChanged"  # its Secret was deleted and made anew
    META_STORE_SECRET_OUTDATED: Final = "MetaStoreSecretOutdated"  # it predates the worker user: delete it
    GROUP_RUNNING: Final = "GroupRunning"
    ENGINE_EXITED: Final = "EngineExited"  # SGLang exited and this cluster cannot restart it alone
    ENGINE_CRASH_LOOPING: Final = "EngineCrashLooping"  # SGLang restarted in place past maxEngineRestarts
    # EngineRecovered
    ENGINE_RESTARTING: Final = "EngineRestarting"
    ENGINE_SERVING: Final = "EngineServing"
    # Failed / Succeeded
    MAX_RESTARTS_EXCEEDED: Final = "MaxRestartsExceeded"
    DEADLINE_EXCEEDED: Final = "DeadlineExceeded"
    FINAL_STEP_RECORDED: Final = "FinalStepRecorded"
    NOT_FINISHED: Final = "NotFinished"
    IPC_PREFLIGHT_FAILED: Final = "IPCPreflightFailed"  # spec.weightSync.ipcPreflight.mode Fail
    TRAINING_FAILED: Final = "TrainingFailed"  # the trainer's final record says the run failed
    PRIVILEGED_NOT_ALLOWED: Final = "PrivilegedNotAllowed"  # privileged security contexts, not allowed here
    CHECKPOINT_REQUEST_NOT_WITHDRAWN: Final = "CheckpointRequestNotWithdrawn"  # resume: the pods wait on it
    # IPCReady (written by the step-event consumer; the failure reasons are the runtime's, events.py)
    PREFLIGHT_PASSED: Final = "PreflightPassed"
    PREFLIGHT_PENDING: Final = "PreflightPending"
    SHM_NOT_SHARED: Final = "ShmNotShared"
    DEVICE_UUID_MISMATCH: Final = "DeviceUUIDMismatch"
    OPEN_MEM_HANDLE_FAILED: Final = "OpenMemHandleFailed"
    PATTERN_MISMATCH: Final = "PatternMismatch"
    PID_NAMESPACE_NOT_SHARED: Final = "PIDNamespaceNotShared"
    PEER_TIMEOUT: Final = "PeerTimeout"
    # RolloutConsistent (written by the step-event consumer from the trainer's rollout reports)
    KL_WITHIN_BOUNDS: Final = "KLWithinBounds"
    KL_OVER_THRESHOLD: Final = "KLOverThreshold"  # over spec.weightSync.rolloutConsistency.klThreshold
    KL_OVER_BASELINE: Final = "KLOverBaseline"  # over baselineFactor x the rolling baseline
    NO_DATA: Final = "NoData"  # steps go on completing, the trainer stopped reporting
    # Failed (action Fail) and Suspended (action SuspendAtStepBoundary); also the breach's Event
    ROLLOUT_INCONSISTENT: Final = "RolloutInconsistent"

    # Events only.
    CREATED_META_STORE: Final = "CreatedMetaStore"
    CREATED_PODS: Final = "CreatedPods"
    FAILED_TO_CREATE: Final = "FailedToCreate"
    RESTARTING_GROUP: Final = "RestartingGroup"
    ENGINE_RESTARTED: Final = "EngineRestarted"  # SGLang restarted in place; no group restart
    DELETED_PODS: Final = "DeletedPods"
    FORCE_DELETED_POD: Final = "ForceDeletedPod"
    RESUMED: Final = "Resumed"
    SUSPENDING: Final = "Suspending"
    JOB_RUNNING: Final = "JobRunning"
    JOB_FAILED: Final = "JobFailed"
    JOB_SUCCEEDED: Final = "JobSucceeded"
    TTL_EXPIRED: Final = "TTLExpired"


# IPCReady=False with one of these is a failure (Fail mode fails the job on it); PreflightPending is not.
IPC_PREFLIGHT_FAILURES: Final = frozenset(
    {
        Reason.SHM_NOT_SHARED,
        Reason.DEVICE_UUID_MISMATCH,
        Reason.OPEN_MEM_HANDLE_FAILED,
        Reason.PATTERN_MISMATCH,
        Reason.PID_NAMESPACE_NOT_SHARED,
        Reason.PEER_TIMEOUT,
    }
)
# RolloutConsistent=False with one of these is a breach (the action applies); NoData is not.
ROLLOUT_BREACHES: Final = frozenset({Reason.KL_OVER_THRESHOLD, Reason.KL_OVER_BASELINE})
