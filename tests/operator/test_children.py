"""The table of a job's children (children.py): each entry's kind, apiVersion and name are what its builder
makes, so what decide creates is what the reconciler looks for."""

from __future__ import annotations

import pytest

from colocate_operator import children
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import KUEUE_QUEUE_LABEL
from colocate_operator.observed import child_key
from colocate_operator.spec import ColocateJob
from tests.operator import factories

CONFIG = OperatorConfig()


def inputs(**override: object) -> children.BuildInputs:
    job = factories.job()
    fields: dict[str, object] = {
        "password": "pw",
        "gang_ready": True,
        "worker_pod": lambda: {"spec": {"containers": []}, "metadata": {"name": f"{job.ref.name}-0"}},
        "workload_seen": False,
    }
    return children.BuildInputs(**(fields | override))  # type: ignore[arg-type]


def queued() -> ColocateJob:
    body = factories.body()
    body["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: "team-a"}
    return ColocateJob.from_body(body)


@pytest.mark.parametrize("native_gang", [False, True])
def test_each_entry_names_what_its_builder_makes(native_gang: bool) -> None:
    job = queued()
    table = children.of(job, OperatorConfig(native_gang=native_gang))
    for child in table:
        if child.read == children.Read.ELSEWHERE:
            continue  # Kueue's Workload: its builder needs a real worker pod (test_kueue.py)
        built = child.build(inputs())
        assert built is not None, child
        assert (built["kind"], built["apiVersion"], child_key(built)) == (
            child.kind,
            child.api_version,
            child.key,
        )
    gang = [c.kind for c in table if c.api_version.startswith("scheduling.k8s.io")]
    assert gang == (["Workload", "PodGroup"] if native_gang else [])


def test_creation_order_puts_the_secret_before_the_redis_that_mounts_it() -> None:
    keys = [c.key for c in children.of(factories.job(), CONFIG)]
    assert keys == [
        "Secret/demo-metastore-auth",
        "Deployment/demo-metastore",
        "Service/demo-metastore",
        "NetworkPolicy/demo-metastore",
        "ResourceClaimTemplate/demo-gpus",
        "Service/demo",
        "NetworkPolicy/demo-workers",
        "PodDisruptionBudget/demo-workers",
    ]
    assert children.metastore_keys(factories.job()) == set(keys[:4])


def test_the_budget_waits_for_a_ready_gang_and_the_kueue_workload_for_none_seen() -> None:
    by_kind = {c.kind: c for c in children.of(queued(), CONFIG)}
    assert by_kind["PodDisruptionBudget"].build(inputs(gang_ready=False)) is None
    assert by_kind["PodDisruptionBudget"].read == children.Read.ONCE_RAN
    assert by_kind["Workload"].build(inputs(workload_seen=True)) is None
    assert by_kind["Deployment"].read == children.Read.WHOLE


def test_an_external_meta_store_has_no_children_here() -> None:
    job = factories.job(
        metaStore={
            "mode": "External",
            "external": {"address": "redis.example.com:6379", "passwordSecretRef": {"name": "s", "key": "k"}},
        }
    )
    kinds = [c.kind for c in children.of(job, CONFIG)]
    assert "Secret" not in kinds and "Deployment" not in kinds
