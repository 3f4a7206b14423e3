"""Deterministic child names, labels and ownerReferences: a restarted operator finds what it made before.

The CRD limits job names to DNS-1035 labels of at most 40 characters, so every name below fits the
63-character limit of Service names and pod hostnames. No two jobs may produce the same child name: the
only child name that is another job's name plus a suffix is the headless Service (the job's name itself),
so the CRD refuses job names ending in a suffix that names another child of the same kind
(RESERVED_SUFFIXES; a unit test enumerates every child of pairs of names).
"""

from __future__ import annotations

from typing import Any

from colocate_operator.constants import (
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    OPERATOR_NAME,
)
from colocate_operator.spec import JobRef

# Job X's Redis Service is X-metastore: a job named X-metastore would get it as its headless Service.
RESERVED_SUFFIXES = ("-metastore",)


def headless_service(job: str) -> str:
    return job


def pod(job: str, index: int) -> str:
    return f"{job}-{index}"


def worker_network_policy(job: str) -> str:
    return f"{job}-workers"


def disruption_budget(job: str) -> str:
    """The workers' PodDisruptionBudget: another kind than the NetworkPolicy, so the same name is free."""
    return f"{job}-workers"


def claim_template(job: str) -> str:
    return f"{job}-gpus"


def metastore(job: str) -> str:
    """The managed Redis Deployment, its Service and its NetworkPolicy share this name."""
    return f"{job}-metastore"


def metastore_secret(job: str) -> str:
    return f"{job}-metastore-auth"


def children(job: str, num_nodes: int) -> list[tuple[str, str]]:
    """(kind, name) of every named child, for the collision test."""
    return [
        ("Service", headless_service(job)),
        ("ResourceClaimTemplate", claim_template(job)),
        ("Deployment", metastore(job)),
        ("Service", metastore(job)),
        ("NetworkPolicy", metastore(job)),
        ("NetworkPolicy", worker_network_policy(job)),
        ("PodDisruptionBudget", disruption_budget(job)),
        ("Secret", metastore_secret(job)),
        *(("Pod", pod(job, i)) for i in range(num_nodes)),
    ]


def pod_fqdn(job: str, index: int, namespace: str, cluster_domain: str) -> str:
    return f"{pod(job, index)}.{headless_service(job)}.{namespace}.svc.{cluster_domain}"


def service_fqdn(service: str, namespace: str, cluster_domain: str) -> str:
    return f"{service}.{namespace}.svc.{cluster_domain}"


def selector(job: str, component: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_COMPONENT: component}


def label_selector(job: str, component: str | None = None) -> str:
    """The string form for list calls."""
    labels = {LABEL_JOB: job} if component is None else selector(job, component)
    return ",".join(f"{k}={v}" for k, v in labels.items())


def labels(job: str, component: str) -> dict[str, str]:
    return {**selector(job, component), LABEL_MANAGED_BY: OPERATOR_NAME}


def owner_reference(ref: JobRef) -> dict[str, Any]:
    """Controller reference: garbage collection deletes every child with the job."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    ref: JobRef,
    name: str,
    component: str,
    *,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**(extra_labels or {}), **labels(ref.name, component)},
        "ownerReferences": [owner_reference(ref)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta
