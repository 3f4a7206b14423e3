"""Pure builder for the workers' PodDisruptionBudget: a node drain may not evict one member of the gang.

Evicting one rank does not shrink a job, it kills it: the others block in a collective until their timeout,
and the operator then restarts the whole group. So voluntary disruptions (the eviction API that `kubectl
drain`, the cluster autoscaler and node upgrades use) are refused while every pod is healthy:
`minAvailable` is the number of pods. An integer, not a percentage nor `maxUnavailable`: for those the
disruption controller looks up the scale subresource of the pods' controller, which a ColocateJob does not
have, and such a budget never syncs (kuberay #2662).

What the budget does not stop: a plain pod delete (`kubectl drain --disable-eviction`, `kubectl delete
pod`), a node that dies, Kueue's or the user's suspend, and the operator's own group restarts; all of those
delete, they do not evict. The operator treats such a deletion as a pod failure and restarts the group.

`unhealthyPodEvictionPolicy: AlwaysAllow`: a pod that is running but not ready (a gang already broken, about
to be restarted) may be evicted, so a stuck job cannot block a node drain forever.
"""

from __future__ import annotations

from typing import Any

from colocate_operator import names
from colocate_operator.constants import COMPONENT_WORKER
from colocate_operator.spec import ColocateJob


def budget(job: ColocateJob) -> dict[str, Any]:
    """Selects the job's worker pods of every group restart (the meta-store's pod is not in it: a Redis
    restart costs a reconnect, not the gang)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.metadata(job.ref, names.disruption_budget(job.ref.name), COMPONENT_WORKER),
        "spec": {
            "minAvailable": job.spec.num_nodes,
            "selector": {"matchLabels": names.selector(job.ref.name, COMPONENT_WORKER)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
