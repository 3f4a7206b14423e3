"""The workers' PodDisruptionBudget as a pure manifest (the drain itself: test_disruption_integration.py)."""

from __future__ import annotations

import pytest

from colocate_operator import disruption, metastore, names, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import COMPONENT_METASTORE
from tests.operator import factories

CONFIG = OperatorConfig()


@pytest.mark.parametrize("num_nodes", [1, 2, 16, 256])
def test_budget_keeps_every_pod_of_the_gang(num_nodes: int) -> None:
    job = factories.job(numNodes=num_nodes, gpusPerNode=8)
    pdb = disruption.budget(job)
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "demo-workers" == names.disruption_budget("demo")
    # An integer equal to the pod count: no voluntary disruption while all are healthy, and no scale
    # subresource needed (a percentage or maxUnavailable would make the controller look one up).
    assert pdb["spec"]["minAvailable"] == num_nodes and isinstance(pdb["spec"]["minAvailable"], int)
    assert "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


def test_budget_selects_exactly_the_jobs_worker_pods() -> None:
    job = factories.job()
    selector = disruption.budget(job)["spec"]["selector"]
    assert selector == {"matchLabels": {"colocate.dev/job": "demo", "colocate.dev/component": "worker"}}
    store = metastore.endpoint(job, CONFIG)
    # Every worker pod of every group restart matches ...
    for restart in (0, 3):
        for pod in pods.pods(job, restart, store, CONFIG):
            assert selector["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # ... and neither Redis's pods nor another job's workers do.
    redis = next(m for m in metastore.managed_children(job, CONFIG, "pw") if m["kind"] == "Deployment")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert redis_labels["colocate.dev/component"] == COMPONENT_METASTORE
    assert not selector["matchLabels"].items() <= redis_labels.items()
    other = factories.job(name="demo2")
    other_pod = pods.pod(other, 0, 0, metastore.endpoint(other, CONFIG), CONFIG)
    assert not selector["matchLabels"].items() <= other_pod["metadata"]["labels"].items()
