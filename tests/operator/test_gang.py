"""Native gang scheduling's pure parts: the Workload and PodGroup of a job, the pods' scheduling group, and
the discovery answer deciding between them and the old path."""

from __future__ import annotations

from dataclasses import replace

from colocate_operator import gang, metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.decide import decide
from colocate_operator.observed import Observed
from tests.operator import factories
from tests.operator.test_decide import NOW


class Discovery:
    def __init__(self, resources: frozenset[str] | Exception) -> None:
        self.resources = resources

    def served_resources(self, api_version: str) -> frozenset[str]:
        assert api_version == "scheduling.k8s.io/v1beta1"
        if isinstance(self.resources, Exception):
            raise self.resources
        return self.resources


def test_workload_and_pod_group_make_all_replicas_one_gang() -> None:
    job = factories.job(numNodes=4)
    workload, group = gang.objects(job)
    assert workload["kind"] == "Workload" and group["kind"] == "PodGroup"
    assert workload["apiVersion"] == group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    assert workload["spec"]["podGroupTemplates"] == [
        {"name": "workers", "schedulingPolicy": {"gang": {"minCount": 4}}}
    ]
    assert workload["spec"]["controllerRef"] == {
        "apiGroup": "colocate.dev",
        "kind": "ColocateJob",
        "name": "demo",
    }
    assert group["spec"] == {
        "workloadRef": {"workloadName": "demo-gang", "templateName": "workers"},
        "schedulingPolicy": {"gang": {"minCount": 4}},
    }
    for obj in (workload, group):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


def test_pods_name_the_pod_group_only_where_the_api_is_served() -> None:
    job = factories.job()
    on = OperatorConfig(native_gang=True)
    store = metastore.endpoint(job, on)
    assert pods.pod(job, 0, 0, store, on)["spec"]["schedulingGroup"] == {"podGroupName": "demo-gang"}
    assert "schedulingGroup" not in pods.pod(job, 0, 0, store, OperatorConfig())["spec"]


def test_decide_creates_the_gang_objects_only_where_the_api_is_served() -> None:
    job = factories.job()

    def kinds(config: OperatorConfig) -> set[str]:
        plan = decide(job, {}, Observed(), NOW, config, "pw")
        return {f"{m['apiVersion']}/{m['kind']}" for m in plan.creates}

    assert {"scheduling.k8s.io/v1beta1/Workload", "scheduling.k8s.io/v1beta1/PodGroup"} <= kinds(
        OperatorConfig(native_gang=True)
    )
    assert not any(k.startswith("scheduling.k8s.io") for k in kinds(OperatorConfig()))


def test_discovery_turns_it_on_only_when_both_resources_are_served() -> None:
    config = OperatorConfig()
    assert gang.discover(Discovery(frozenset({"workloads", "podgroups"})), config).native_gang
    assert not gang.discover(Discovery(frozenset({"workloads"})), config).native_gang
    assert not gang.discover(Discovery(frozenset()), config).native_gang
    assert not gang.discover(Discovery(RuntimeError("discovery down")), config).native_gang
    assert replace(config, native_gang=True).native_gang
