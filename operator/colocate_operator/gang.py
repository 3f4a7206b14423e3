"""Native gang scheduling through Kubernetes' Workload API (scheduling.k8s.io/v1beta1, Kubernetes 1.37).

Where the cluster serves the API (the `GenericWorkload` feature gate on the apiserver and the scheduler, and
`scheduling.k8s.io/v1beta1` enabled: a beta API the apiserver serves only when asked), each job gets a
`Workload` with one pod-group template, `workers`, whose gang policy is `minCount = numNodes`, and one
`PodGroup` made from it; every worker pod names that PodGroup in `spec.schedulingGroup.podGroupName`. The
scheduler's GangScheduling plugin then binds the pods all together or not at all: with GPUs for fewer than
all of them, none binds and none holds GPUs another job could use.

In 1.37 a pod points at a PodGroup (`spec.schedulingGroup`), not at the Workload: the field that pointed at
the Workload (`spec.workloadRef`, 1.35) was replaced in 1.36. PodGroups are normally made by a workload
controller from the Workload's templates; the operator is that controller for its jobs. One PodGroup serves
every group restart: the old pods are gone before the new ones are created (decide.py), and `minCount` is
checked each time pods of the group are scheduled.

Where the API is not served, nothing here is created and pods carry no scheduling group: the placement
timeout (spec.scheduling.placementTimeoutSeconds) stays the only guard against a half-placed gang. The
operator asks API discovery once, at start (`served`): enabling the gate later needs an operator restart.

Pure builders, plus `served`, the one discovery read.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from colocate_operator import names
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import COMPONENT_WORKER, GROUP, KIND
from colocate_operator.spec import ColocateJob

API_VERSION = "scheduling.k8s.io/v1beta1"
TEMPLATE = "workers"  # the Workload's one pod-group template
RESOURCES = frozenset({"workloads", "podgroups"})


class Discovery(Protocol):
    def served_resources(self, api_version: str) -> frozenset[str]: ...


log = logging.getLogger("colocate_operator.gang")


def served(api: Discovery) -> bool:
    """True when the cluster serves both the Workload and the PodGroup resource (a discovery read)."""
    return api.served_resources(API_VERSION) >= RESOURCES


def discover(api: Discovery, config: OperatorConfig) -> OperatorConfig:
    """`config` with `native_gang` as the cluster says; off (today's placement) if discovery fails."""
    try:
        on = served(api)
    except Exception as e:  # a discovery error must not stop the operator: it falls back
        log.warning("API discovery of %s failed (%s): native gang scheduling off", API_VERSION, e)
        on = False
    log.info(
        "native gang scheduling %s",
        f"on ({API_VERSION} workloads and podgroups served)"
        if on
        else f"off ({API_VERSION} workloads/podgroups not served)",
    )
    return replace(config, native_gang=on)


def name(job: str) -> str:
    """The Workload's and the PodGroup's name (two kinds, one name; distinct from Kueue's Workload)."""
    return f"{job}-gang"


def _policy(job: ColocateJob) -> dict[str, Any]:
    return {"gang": {"minCount": job.spec.num_nodes}}


def _object(job: ColocateJob, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": names.metadata(job.ref, name(job.ref.name), COMPONENT_WORKER),
        "spec": spec,
    }


def workload(job: ColocateJob) -> dict[str, Any]:
    controller = {"apiGroup": GROUP, "kind": KIND, "name": job.ref.name}
    templates = [{"name": TEMPLATE, "schedulingPolicy": _policy(job)}]
    return _object(job, "Workload", {"controllerRef": controller, "podGroupTemplates": templates})


def pod_group(job: ColocateJob) -> dict[str, Any]:
    workload_ref = {"workloadName": name(job.ref.name), "templateName": TEMPLATE}
    return _object(job, "PodGroup", {"workloadRef": workload_ref, "schedulingPolicy": _policy(job)})


def objects(job: ColocateJob) -> list[dict[str, Any]]:
    """The Workload first: the PodGroup names it."""
    return [workload(job), pod_group(job)]


def scheduling_group(job: ColocateJob) -> dict[str, Any]:
    """A worker pod's `spec.schedulingGroup`."""
    return {"podGroupName": name(job.ref.name)}
