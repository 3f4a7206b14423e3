"""The table of a job's children that outlive its pod groups: kind, name, builder, and how the reconciler
looks for each. Pure. decide.py builds from it what is missing; Reconciler._observe reads from it what
exists: one list, so a child cannot be created without being looked for, or the other way round.

In creation order: the meta-store's Secret before the Redis Deployment that mounts it. Worker pods are not
here (a group's, recreated on every restart: pods.py, pod_gate.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from colocate_operator import disruption, gang, gpus, kueue, metastore, names, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.spec import ColocateJob

NETWORK_POLICY, NETWORKING = "NetworkPolicy", "networking.k8s.io/v1"
CLAIM_TEMPLATE, DRA = "ResourceClaimTemplate", "resource.k8s.io/v1"


class Read(StrEnum):
    """How a pass learns whether the child exists."""

    METADATA = "metadata"  # existence and owner only (a Secret's data never enters memory); remembered
    WHOLE = "whole"  # every pass, the whole object: the Redis Deployment's readiness
    ONCE_RAN = "once-ran"  # metadata, but not before the job last ran: it is created once the gang is ready
    ELSEWHERE = "elsewhere"  # Kueue's Workload: workloads.py reads it (admission, eviction)


@dataclass(frozen=True)
class BuildInputs:
    """What some builders need beside the job: decide.py fills it from the pass."""

    password: str  # the Secret's, used only if it is created
    gang_ready: bool  # every pod of the group is ready: the disruption budget is wanted
    worker_pod: Callable[[], dict[str, Any]]  # Kueue's pod set template
    workload_seen: bool  # the Kueue Workload exists (ours or not): never created again
    workload_priority: int | None = None


@dataclass(frozen=True)
class Child:
    kind: str
    api_version: str
    name: str
    read: Read
    build: Callable[[BuildInputs], dict[str, Any] | None]  # None: not wanted now

    @property
    def key(self) -> str:
        """As observed.child_key names it."""
        return f"{self.kind}/{self.name}"


def of(job: ColocateJob, config: OperatorConfig) -> tuple[Child, ...]:
    """The job's children, in creation order."""
    return (*_metastore(job, config), *_workers(job), *_scheduling(job, config))


def _metastore(job: ColocateJob, config: OperatorConfig) -> list[Child]:
    """The Managed meta-store's (an External one is the user's)."""
    if job.spec.meta_store.mode != "Managed":
        return []
    name = names.metastore(job.ref.name)
    secret = names.metastore_secret(job.ref.name)
    return [
        Child("Secret", "v1", secret, Read.METADATA, lambda b: metastore.secret(job, b.password)),
        Child("Deployment", "apps/v1", name, Read.WHOLE, lambda b: metastore.deployment(job)),
        Child("Service", "v1", name, Read.METADATA, lambda b: metastore.service(job)),
        Child(
            NETWORK_POLICY, NETWORKING, name, Read.METADATA, lambda b: metastore.network_policy(job, config)
        ),
    ]


def _workers(job: ColocateJob) -> list[Child]:
    """What the worker pods of every group share: their GPUs' claim template, Services, budget."""
    ref = job.ref.name
    table = []
    if gpus.uses_dra(job):
        template = names.claim_template(ref)
        table.append(Child(CLAIM_TEMPLATE, DRA, template, Read.METADATA, lambda b: gpus.claim_template(job)))
    return [
        *table,
        Child(
            "Service", "v1", names.headless_service(ref), Read.METADATA, lambda b: pods.headless_service(job)
        ),
        Child(
            NETWORK_POLICY,
            NETWORKING,
            names.worker_network_policy(ref),
            Read.METADATA,
            lambda b: pods.network_policy(job),
        ),
        # Guards a whole gang: created once every pod of the group is ready (until then no eviction it could
        # refuse would cost more than a bring-up, and the disruption controller would rewrite its status as
        # each pod comes up); it then stays through group restarts.
        Child(
            "PodDisruptionBudget",
            "policy/v1",
            names.disruption_budget(ref),
            Read.ONCE_RAN,
            lambda b: disruption.budget(job) if b.gang_ready else None,
        ),
    ]


def _scheduling(job: ColocateJob, config: OperatorConfig) -> list[Child]:
    """Kueue's Workload for a queued job (its pod set's template is the worker pod itself), and the native
    gang's Workload and PodGroup (the Workload first: the PodGroup names it)."""
    table = []
    if kueue.queue_name(job) is not None:
        table.append(
            Child(
                "Workload",
                kueue.API_VERSION,
                kueue.workload_name(job.ref.name),
                Read.ELSEWHERE,
                lambda b: (
                    None if b.workload_seen else kueue.workload(job, b.worker_pod(), b.workload_priority)
                ),
            )
        )
    if config.native_gang:
        name = gang.name(job.ref.name)
        table += [
            Child("Workload", gang.API_VERSION, name, Read.METADATA, lambda b: gang.workload(job)),
            Child("PodGroup", gang.API_VERSION, name, Read.METADATA, lambda b: gang.pod_group(job)),
        ]
    return table


def metastore_keys(job: ColocateJob) -> set[str]:
    """The Managed meta-store's children, as observed.child_key names them."""
    name = names.metastore(job.ref.name)
    return {
        f"Secret/{names.metastore_secret(job.ref.name)}",
        f"Deployment/{name}",
        f"Service/{name}",
        f"NetworkPolicy/{name}",
    }


def secret_key(job: ColocateJob) -> str:
    return f"Secret/{names.metastore_secret(job.ref.name)}"


def deployment_key(job: ColocateJob) -> str:
    return f"Deployment/{names.metastore(job.ref.name)}"
