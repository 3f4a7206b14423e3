"""Real Kueue for the integration tests: started once per session's cluster, and a quota (flavor, ClusterQueue
with room for exactly one job, LocalQueue) per test. The fixtures in conftest.py call these."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate_devcluster.kueue import Kueue

GPU = "nvidia.com/gpu"
NODES, GPUS = 2, 8  # one job: 16 GPUs, the whole ClusterQueue's quota
QUEUE = "team"
FLAVOR_LABELS = {"colocate.dev/gpu-node": "true"}  # the fake GPU nodes' label: the flavor is their pool


_STARTED: dict[Path, Kueue] = {}


def started_kueue(cluster: Any) -> Kueue:
    """Kueue for this session's cluster, started by the first module that asks (loading its CRDs costs a
    minute or two on a busy machine) and left running: it is one of the cluster's components, stopped with
    it, and it leaves alone everything without a queue."""
    running = _STARTED.get(cluster.workdir)
    if running is None or running.component is None or not running.component.alive():
        running = _STARTED[cluster.workdir] = Kueue(cluster).start()
    return running


@dataclass
class Quota:
    flavor: str
    cluster_queue: str
    priority_classes: list[str]


def quota_for(cluster: Any, namespace: str) -> Iterator[Quota]:
    """A ResourceFlavor, a ClusterQueue with quota for exactly one job (preempting lower priorities) and a
    LocalQueue in the test's namespace; removed, jobs first, while Kueue still runs (its finalizers)."""
    made = Quota(f"rf-{namespace}", f"cq-{namespace}", [])
    cluster.apply(
        [
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ResourceFlavor",
                "metadata": {"name": made.flavor},
                "spec": {"nodeLabels": FLAVOR_LABELS},
            },
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ClusterQueue",
                "metadata": {"name": made.cluster_queue},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [
                        {
                            "coveredResources": [GPU],
                            "flavors": [
                                {
                                    "name": made.flavor,
                                    "resources": [{"name": GPU, "nominalQuota": NODES * GPUS}],
                                }
                            ],
                        }
                    ],
                },
            },
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "LocalQueue",
                "metadata": {"name": QUEUE, "namespace": namespace},
                "spec": {"clusterQueue": made.cluster_queue},
            },
        ]
    )
    yield made
    cluster.kubectl(
        "delete", "colocatejobs", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
    )
    cluster.kubectl(
        "delete", "workloads", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
    )
    cluster.kubectl("delete", "localqueue", QUEUE, "-n", namespace, "--timeout=60s", check=False)
    cluster.kubectl("delete", "clusterqueue", made.cluster_queue, "--timeout=60s", check=False)
    cluster.kubectl("delete", "resourceflavor", made.flavor, "--timeout=60s", check=False)
    for klass in made.priority_classes:
        cluster.kubectl("delete", "workloadpriorityclass", klass, check=False)
