"""Pure builders for the worker pods, their headless Service and their NetworkPolicy, including the pod
environment (rendered from the contract's table, colocate_runtime.contract.env).

Each pod holds a trainer and an SGLang (rollout) container on the same GPUs, with a shared PID namespace,
one memory-backed /dev/shm and one socket directory mounted in both. The in-pod runtime reads the
COLOCATE_* variables below (the table in operator/README.md is generated from the contract's); both
containers get the same set, plus COLOCATE_CONTAINER telling them apart, and SGLANG_API_KEY from
spec.rollout.apiKeySecretRef where set.

Pods are built to pass Pod Security "restricted" (non-root, seccomp RuntimeDefault, no privilege escalation,
all capabilities dropped, no service account token); the spec's securityContext fields replace these
defaults key by key. `shareProcessNamespace` is allowed by restricted and needed for CUDA IPC; it makes the
two containers one trust domain, which they are anyway (the trainer drives SGLang and holds its key).
"""

from __future__ import annotations

from typing import Any

from colocate_operator import gang, gpus, names, placement
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    COMPONENT_WORKER,
    CONTAINER_ROLLOUT,
    CONTAINER_TRAINER,
    KUEUE_QUEUE_LABEL,
    LABEL_REPLICA_INDEX,
    LABEL_RESTART,
    SHM_MOUNT_PATH,
    SHM_VOLUME,
    SOCKET_MOUNT_PATH,
    SOCKET_VOLUME,
)
from colocate_operator.metastore import MetaStoreEndpoint
from colocate_operator.spec import DEFAULT_PORTS, ColocateJob, ColocateJobSpec
from colocate_runtime.contract import env

ROLES = (CONTAINER_TRAINER, CONTAINER_ROLLOUT)
PORT_NAMES = {CONTAINER_TRAINER: "rendezvous", CONTAINER_ROLLOUT: "http"}
API_KEY_ENV = env.SGLANG_API_KEY.name
DEFAULT_POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
DEFAULT_CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
# Set by the operator only (the CRD rejects them in user env too; dropped here for an older CRD).
OPERATOR_ENV = frozenset({"NVIDIA_VISIBLE_DEVICES", API_KEY_ENV})


def port(job: ColocateJob, role: str) -> int:
    return job.spec.container(role).port or DEFAULT_PORTS[role]


def headless_service(job: ColocateJob) -> dict[str, Any]:
    """The stable DNS name <job>-0.<job>.<ns>.svc of the rendezvous, published before the pod is ready.

    It selects pod 0 alone: the rendezvous is the only name anything dials (the other ranks reach each other
    by the addresses they exchange through it), and every pod a headless Service selects costs the
    controller-manager an EndpointSlice and an Endpoints write as it comes up, for each group restart."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(job.ref, names.headless_service(job.ref.name), COMPONENT_WORKER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {**names.selector(job.ref.name, COMPONENT_WORKER), LABEL_REPLICA_INDEX: "0"},
            "ports": [
                {
                    "name": PORT_NAMES[role],
                    "port": port(job, role),
                    "targetPort": port(job, role),
                    "protocol": "TCP",
                }
                for role in ROLES
            ],
        },
    }


def network_policy(job: ColocateJob) -> dict[str, Any]:
    """Ingress to the worker pods only from the job's own worker pods, on every port: the rendezvous and
    SGLang ports, and the ports NCCL and gloo open between ranks, which are not known in advance. Nothing
    else (the operator talks to the meta-store, never to the pods); kubelet probes from the node are always
    allowed by NetworkPolicy. Policies add up, so a user opens more with a policy of their own."""
    workers = {"matchLabels": names.selector(job.ref.name, COMPONENT_WORKER)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(job.ref, names.worker_network_policy(job.ref.name), COMPONENT_WORKER),
        "spec": {
            "podSelector": workers,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": workers}]}],
        },
    }


def contract_env(
    job: ColocateJob, index: int, restart: int, role: str, store: MetaStoreEndpoint, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The pod's variables of the contract's table (contract/env.py), identical in both containers except
    COLOCATE_CONTAINER; each is rendered by its table entry, so names and types are written once."""
    spec = job.spec
    train, infer = spec.parallelism.train, spec.parallelism.inference
    rendezvous = names.pod_fqdn(job.ref.name, 0, job.ref.namespace, config.cluster_domain)
    values: list[tuple[env.Var, object]] = [
        (env.JOB_NAME, job.ref.name),
        (env.NAMESPACE, job.ref.namespace),
        (env.REPLICA_INDEX, index),
        (env.NUM_NODES, spec.num_nodes),
        (env.GPUS_PER_NODE, spec.gpus_per_node),
        (env.RENDEZVOUS_ADDR, f"{rendezvous}:{port(job, CONTAINER_TRAINER)}"),
        (env.METASTORE_ADDR, store.address),
        (env.BUCKET_MB, spec.weight_sync.bucket_mb),
        (env.STEP_TIMEOUT_SECONDS, spec.weight_sync.step_timeout_seconds),
        (env.TRANSPORT, spec.weight_sync.transport),
        (env.VERIFY, spec.weight_sync.verify),
        (env.ROLLOUT_WEIGHTS, spec.weight_sync.rollout_weights),
        (env.IPC_PREFLIGHT, spec.weight_sync.ipc_preflight.mode),
        (env.IPC_PREFLIGHT_TIMEOUT_SECONDS, spec.weight_sync.ipc_preflight.timeout_seconds),
        (env.STEP_SUMMARY_GPUS, spec.world_size),  # one stream record a step, not one a GPU (steps.py)
        (env.TRAIN_TP, train.tensor),
        (env.TRAIN_PP, train.pipeline),
        (env.TRAIN_EP, train.expert),
        (env.TRAIN_CP, train.context),
        (env.INFER_TP, infer.tensor),
        (env.INFER_DP, infer.data),
        (env.INFER_EP, infer.expert),
        (env.MODEL_ARCH, spec.model.arch),
        (env.CONTAINER, role),
        (env.RESTART_COUNT, restart),
        (env.ROLLOUT_PORT, port(job, CONTAINER_ROLLOUT)),
        (env.SOCKET_DIR, SOCKET_MOUNT_PATH),
    ]
    if spec.model.config:
        values.append((env.MODEL_CONFIG, spec.model.config))
    rendered = [var.render(value) for var, value in values]
    rendered.extend(metastore_credentials_env(store))
    key = spec.rollout.api_key_secret_ref
    if key is not None:
        # Both containers: SGLang runs with it, the trainer's client sends it.
        rendered.append(secret_env(env.SGLANG_API_KEY, key.name, key.key))
    return rendered


def secret_env(var: env.Var, secret: str, key: str, *, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": var.name, "valueFrom": {"secretKeyRef": ref}}


def metastore_credentials_env(store: MetaStoreEndpoint) -> list[dict[str, Any]]:
    """The pods' Redis user and password: Managed, the worker user (the job's keys, no admin command);
    External, the Secret's `username` key when it has one (else Redis's `default` user)."""
    rendered = []
    if store.username is not None:
        rendered.append(env.METASTORE_USERNAME.render(store.username))
    elif store.username_key is not None:
        rendered.append(
            secret_env(env.METASTORE_USERNAME, store.secret_name, store.username_key, optional=True)
        )
    rendered.append(secret_env(env.METASTORE_PASSWORD, store.secret_name, store.pods_password_key))
    return rendered


def privileged_fields(spec: ColocateJobSpec) -> list[str]:
    """The fields of the spec's security contexts that ask for more than Pod Security "restricted" allows:
    a privileged container, an added capability other than NET_BIND_SERVICE, Unconfined seccomp, UID 0. The
    CRD refuses them unless `spec.pod.allowPrivileged`; the operator creates such pods only in the
    namespaces its administrator listed (config.privileged_namespaces), whatever the CRD let through."""
    found: list[str] = []
    contexts = [
        ("spec.trainer.securityContext", spec.trainer.security_context),
        ("spec.rollout.securityContext", spec.rollout.security_context),
        ("spec.pod.securityContext", spec.pod.security_context),
    ]
    for where, context in contexts:
        if context.get("privileged") is True:
            found.append(f"{where}.privileged")
        added = (context.get("capabilities") or {}).get("add") or []
        if any(cap != "NET_BIND_SERVICE" for cap in added):
            found.append(f"{where}.capabilities.add")
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}.seccompProfile")
        if context.get("runAsUser") == 0:
            found.append(f"{where}.runAsUser")
    return found


def security_context(defaults: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """The user's fields replace the defaults' one by one (a user `capabilities` replaces ours whole). A
    privileged container drops our `allowPrivilegeEscalation: false` unless the user set it: the API server
    refuses the two together."""
    merged = {**defaults, **user}
    if user.get("privileged") is True and "allowPrivilegeEscalation" not in user:
        merged.pop("allowPrivilegeEscalation", None)
    return merged


def rollout_probes() -> dict[str, Any]:
    """SGLang's probes: its HTTP port accepting connections (SGLang listens only once its model is loaded).
    Not `/health`: it generates a token and fails while the engine is paused for training, so a probe on it
    would restart SGLang in the middle of every step; not `/ready` (503 while paused) nor `/model_info` (401
    when SGLang runs with an API key). Startup allows 30 minutes for a large model to load."""
    get = {"tcpSocket": {"port": PORT_NAMES[CONTAINER_ROLLOUT]}, "timeoutSeconds": 10}
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**get, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**get, "periodSeconds": 20, "failureThreshold": 6},
    }


def engine_restart_rules() -> dict[str, Any]:
    """SGLang alone restarts in place when it crashes (a non-zero exit), while the trainer runs on and then
    re-pushes its current weights to it (runtime/colocated/repush.py): container restart rules (Kubernetes
    1.35+, beta, on by default as ContainerRestartRules). A clean exit (0) is not restarted. Where the
    apiserver lacks the feature it drops these fields, and the operator restarts the group instead
    (decide.py, EngineExited)."""
    return {
        "restartPolicy": "Never",
        "restartPolicyRules": [{"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0]}}],
    }


def container(
    job: ColocateJob, index: int, restart: int, role: str, store: MetaStoreEndpoint, config: OperatorConfig
) -> dict[str, Any]:
    user = job.spec.container(role)
    body: dict[str, Any] = {"name": role, "image": user.image}
    if user.image_pull_policy:
        body["imagePullPolicy"] = user.image_pull_policy
    if user.command is not None:
        body["command"] = list(user.command)
    if user.args is not None:
        body["args"] = list(user.args)
    # The contract first; user variables cannot collide (the CRD reserves the COLOCATE_ prefix).
    body["env"] = [
        *contract_env(job, index, restart, role, store, config),
        *gpus.container_env(job, role),
        *(dict(e) for e in user.env if e.get("name") not in OPERATOR_ENV),
    ]
    body["ports"] = [{"name": PORT_NAMES[role], "containerPort": port(job, role), "protocol": "TCP"}]
    if role == CONTAINER_ROLLOUT:
        body.update(rollout_probes())
        body.update(engine_restart_rules())
    body["resources"] = gpus.container_resources(job, role, user.resources)
    body["volumeMounts"] = [
        {"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH},
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_MOUNT_PATH},
    ]
    body["securityContext"] = security_context(DEFAULT_CONTAINER_SECURITY, user.security_context)
    return body


def pod(
    job: ColocateJob, index: int, restart: int, store: MetaStoreEndpoint, config: OperatorConfig
) -> dict[str, Any]:
    """Pod `index` of group incarnation `restart` (= status.restarts when it is created)."""
    spec = job.spec
    name = names.pod(job.ref.name, index)
    extra_labels = {**spec.pod.labels, LABEL_REPLICA_INDEX: str(index), LABEL_RESTART: str(restart)}
    annotations = dict(spec.pod.annotations)
    # A queued job is a Kueue Workload of its own (kueue.py) and its pods exist only once it is admitted: they
    # carry no queue label, which would have Kueue's pod integration queue them a second time.
    extra_labels.pop(KUEUE_QUEUE_LABEL, None)
    annotations.update(gpus.topology_annotations(job))
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": names.headless_service(job.ref.name),
        # The operator restarts the whole group; a container restarted alone would rejoin a dead world.
        "restartPolicy": "Never",
        "shareProcessNamespace": True,
        "enableServiceLinks": False,
        "automountServiceAccountToken": spec.pod.automount_service_account_token,
        "securityContext": security_context(DEFAULT_POD_SECURITY, spec.pod.security_context),
        "terminationGracePeriodSeconds": spec.pod.termination_grace_period_seconds,
        "tolerations": [gpus.gpu_toleration(), *(dict(t) for t in spec.scheduling.tolerations)],
        **placement.one_pod_per_node(job),  # one pod of the job a node, cheaply for the scheduler
        "volumes": [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.pod.shm_size}},
            {"name": SOCKET_VOLUME, "emptyDir": {}},
        ],
        "containers": [container(job, index, restart, role, store, config) for role in ROLES],
    }
    claims = gpus.pod_resource_claims(job)
    if claims:
        pod_spec["resourceClaims"] = claims
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    if spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
    if config.native_gang:
        # All or nothing: the scheduler binds the pods of this PodGroup together (gang.py).
        pod_spec["schedulingGroup"] = gang.scheduling_group(job)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": names.metadata(
            job.ref, name, COMPONENT_WORKER, extra_labels=extra_labels, annotations=annotations
        ),
        "spec": pod_spec,
    }


def pods(
    job: ColocateJob, restart: int, store: MetaStoreEndpoint, config: OperatorConfig
) -> list[dict[str, Any]]:
    return [pod(job, i, restart, store, config) for i in range(job.spec.num_nodes)]
