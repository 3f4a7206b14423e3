"""Pure builders for the job's meta-store: Secret, Redis Deployment, Service, NetworkPolicy.

The passwords live only in the Secret. Redis reads them (as SHA-256 digests) from a config file mounted from
that Secret, so they are neither in a pod spec nor on a process command line; the job's pods get theirs
through secretKeyRef.

Two Redis users (ACL, `redis_config`): `default`, the operator's, may run anything; `colocate-worker`, the
job's pods', may run what the runtime's protocol needs on the job's own keys only (`~colocate:<ns>:<job>:*`),
and no admin or dangerous command (CLIENT PAUSE/KILL, CONFIG, DEBUG, MONITOR, SHUTDOWN, ACL, FLUSHALL, KEYS,
...): a container of the job can neither stall nor reconfigure the store the operator reads. The worker's
password is derived from the operator's (HMAC-SHA256, one way): the pods cannot compute the operator's.

The Secret is immutable: an edit cannot hand Redis and the pods different passwords. A new password is a new
Secret: delete it, and the operator creates it again with fresh passwords and restarts Redis and the pods on
it (decide.py, MetaStorePasswordChanged).

Redis always runs under a memory limit with `maxmemory` below it and `noeviction`: a write the store cannot
hold is refused with an error the writer reports ("OOM command not allowed"), where without it the kernel
would kill Redis and every step in flight would lose its keys.

No reply to an ordinary client may exceed OUTPUT_BUFFER_LIMIT (`client-output-buffer-limit normal`): Redis
closes the connection instead of sending it. Any container of the job can write values of hundreds of MB;
this bounds what a reader (the operator's step follower and checkpoint reads among them) can be sent, beside
their own bounded reads. The largest legitimate reply, a big model's layout, is a few MB.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from colocate_operator import names
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    COMPONENT_METASTORE,
    COMPONENT_WORKER,
    REDIS_CONFIG_MOUNT,
    REDIS_PORT,
    SECRET_CONFIG_KEY,
    SECRET_FORMAT,
    SECRET_FORMAT_ANNOTATION,
    SECRET_PASSWORD_KEY,
    SECRET_USERNAME_KEY,
    SECRET_WORKER_PASSWORD_KEY,
    WORKER_REDIS_USER,
)
from colocate_operator.quantity import parse_quantity
from colocate_operator.spec import ColocateJob
from colocate_runtime.contract.jobkeys import job_prefix

REDIS_UID = 999  # the redis user of the official images
DEFAULT_REDIS_RESOURCES: dict[str, dict[str, Any]] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"memory": "1Gi"},
}
# maxmemory is this share of the container's memory limit: the rest is headroom for what Redis holds outside
# its dataset accounting (allocator fragmentation, the process itself, Lua, reply buffers of XREADs).
MAXMEMORY_SHARE = 0.75
# Hard limit of one ordinary client's pending output (a reply larger than this closes its connection); no soft
# limit, so a slow but honest reader of a big layout is never cut off.
OUTPUT_BUFFER_LIMIT = "64mb"
# What the worker user may not run beside the @admin and @dangerous categories: key-name listings (the key
# patterns do not filter them), and script and function management (another client's scripts).
WORKER_DENIED = ("-scan", "-randomkey", "-function", "-script|flush", "-script|kill")


@dataclass(frozen=True)
class MetaStoreEndpoint:
    """What the pods need: an address and where the password is (never the password itself). `secret_key` is
    the operator's password; `pod_secret_key` the pods' (Managed: the worker user's), and the pods' Redis
    user is `username` (Managed) or the Secret's `username_key` when present (External)."""

    mode: str
    address: str
    secret_name: str
    secret_key: str
    # Whether the operator may dial it with the password: its own Managed Redis always, an External one only
    # when the operator's allow-list names it (addresses.py). A refused job gets no pods.
    allowed: bool = True
    pod_secret_key: str = ""
    username: str | None = None
    username_key: str | None = None

    @property
    def pods_password_key(self) -> str:
        return self.pod_secret_key or self.secret_key

    def refusal(self) -> str:
        return (
            f"external Redis address {self.address} is not on the operator's allow-list (chart value "
            "externalMetaStore.allowedAddresses, COLOCATE_EXTERNAL_METASTORE_ALLOW): ask the operator's "
            "administrator to add it"
        )


def endpoint(job: ColocateJob, config: OperatorConfig) -> MetaStoreEndpoint:
    store = job.spec.meta_store
    if store.mode == "External":
        assert store.external is not None  # the CRD requires it for External
        ref = store.external.password_secret_ref
        address = store.external.address
        allowed = config.external_metastore_allow.allows(address)
        return MetaStoreEndpoint(
            "External", address, ref.name, ref.key, allowed, username_key=SECRET_USERNAME_KEY
        )
    host = names.service_fqdn(names.metastore(job.ref.name), job.ref.namespace, config.cluster_domain)
    return MetaStoreEndpoint(
        "Managed",
        f"{host}:{REDIS_PORT}",
        names.metastore_secret(job.ref.name),
        SECRET_PASSWORD_KEY,
        pod_secret_key=SECRET_WORKER_PASSWORD_KEY,
        username=WORKER_REDIS_USER,
    )


def worker_password(password: str) -> str:
    """The worker user's password, derived one way from the operator's (the Secret holds both)."""
    return hmac.new(password.encode(), b"colocate-worker", hashlib.sha256).hexdigest()


def _digest(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def worker_acl(namespace: str, job: str) -> str:
    """The worker user's rules, without its name and password: the job's keys, no channels, no admin or
    dangerous command but INFO (the runtime reads the server's run_id to notice a restart). The same rules
    suit a per-job user of a shared External store (operator/README.md, "Meta-store users")."""
    return " ".join(
        [
            "resetkeys",
            f"~{job_prefix(namespace, job)}:*",
            "resetchannels",
            "-@all",
            "+@all",
            "-@admin",
            "-@dangerous",
            "+info",
            *WORKER_DENIED,
        ]
    )


def redis_config(password: str, namespace: str = "", job: str = "") -> str:
    """The managed Redis's config: the operator's `default` user, the pods' worker user (when the job is
    named) limited to the job's keys. No persistence: per-step coordination keys with TTLs, nothing worth a
    disk."""
    users = [f"user default on {_digest(password)} ~* &* +@all"]
    if job:
        users.append(
            f"user {WORKER_REDIS_USER} reset on {_digest(worker_password(password))} "
            + worker_acl(namespace, job)
        )
    return "\n".join(
        [
            f"port {REDIS_PORT}",
            *users,
            'save ""',
            "appendonly no",
            "dir /data",
            f"client-output-buffer-limit normal {OUTPUT_BUFFER_LIMIT} 0 0",
            "",
        ]
    )


def secret(job: ColocateJob, password: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": names.metadata(
            job.ref,
            names.metastore_secret(job.ref.name),
            COMPONENT_METASTORE,
            annotations={SECRET_FORMAT_ANNOTATION: SECRET_FORMAT},
        ),
        "type": "Opaque",
        "immutable": True,  # an edit would split Redis and the pods; a new password is a new Secret
        "stringData": {
            SECRET_PASSWORD_KEY: password,
            SECRET_WORKER_PASSWORD_KEY: worker_password(password),
            SECRET_CONFIG_KEY: redis_config(password, job.ref.namespace, job.ref.name),
        },
    }


def redis_resources(job: ColocateJob) -> dict[str, dict[str, Any]]:
    """The user's resources, or the defaults; a memory limit always, since maxmemory is derived from it: when
    none is given, the default limit or the memory request if that is larger (a limit below it is invalid)."""
    given = job.spec.meta_store.resources
    if not given:
        return DEFAULT_REDIS_RESOURCES
    limits = dict(given.get("limits") or {})
    if "memory" not in limits:
        default = DEFAULT_REDIS_RESOURCES["limits"]["memory"]
        request = (given.get("requests") or {}).get("memory")
        bigger = request is not None and parse_quantity(request) > parse_quantity(default)
        limits["memory"] = request if bigger else default
    return {**given, "limits": limits}


def maxmemory_bytes(memory_limit: str) -> int:
    """MAXMEMORY_SHARE of the limit, never 0 (to Redis, 0 means no limit at all)."""
    return max(1, int(parse_quantity(memory_limit) * Decimal(str(MAXMEMORY_SHARE))))


def redis_command(resources: dict[str, dict[str, Any]]) -> list[str]:
    # On the command line, not in the Secret's config: it follows the resources of the Deployment it is in.
    return [
        "redis-server",
        f"{REDIS_CONFIG_MOUNT}/{SECRET_CONFIG_KEY}",
        "--maxmemory",
        str(maxmemory_bytes(str(resources["limits"]["memory"]))),
        "--maxmemory-policy",
        "noeviction",
    ]


def deployment(job: ColocateJob) -> dict[str, Any]:
    name = names.metastore(job.ref.name)
    store = job.spec.meta_store
    resources = redis_resources(job)
    container = {
        "name": "redis",
        "image": store.image,
        "command": redis_command(resources),
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": REDIS_CONFIG_MOUNT, "readOnly": True},
            {"name": "data", "mountPath": "/data"},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.metadata(job.ref, name, COMPONENT_METASTORE),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two Redis instances with diverging state
            "selector": {"matchLabels": names.selector(job.ref.name, COMPONENT_METASTORE)},
            "template": {
                "metadata": {"labels": names.labels(job.ref.name, COMPONENT_METASTORE)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": REDIS_UID,
                        "runAsGroup": REDIS_UID,
                        "fsGroup": REDIS_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "config",
                            "secret": {
                                "secretName": names.metastore_secret(job.ref.name),
                                "items": [{"key": SECRET_CONFIG_KEY, "path": SECRET_CONFIG_KEY}],
                                "defaultMode": 0o440,
                            },
                        },
                        {"name": "data", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def service(job: ColocateJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(job.ref, names.metastore(job.ref.name), COMPONENT_METASTORE),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector(job.ref.name, COMPONENT_METASTORE),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


def network_policy(job: ColocateJob, config: OperatorConfig) -> dict[str, Any]:
    """Only this job's pods (and the operator, when it runs in the cluster) may reach its Redis."""
    peers: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": names.selector(job.ref.name, COMPONENT_WORKER)}}
    ]
    if config.operator_namespace:
        peers.append(
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}
                },
                "podSelector": {"matchLabels": dict(config.operator_pod_labels)},
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(job.ref, names.metastore(job.ref.name), COMPONENT_METASTORE),
        "spec": {
            "podSelector": {"matchLabels": names.selector(job.ref.name, COMPONENT_METASTORE)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
        },
    }


def managed_children(job: ColocateJob, config: OperatorConfig, password: str) -> list[dict[str, Any]]:
    """In creation order: the Secret before the Deployment that mounts it."""
    if job.spec.meta_store.mode != "Managed":
        return []
    return [secret(job, password), deployment(job), service(job), network_policy(job, config)]
