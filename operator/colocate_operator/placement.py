"""Where a job's worker pods land relative to each other: one pod of the job per node (each pod is one node of
the training world: its GPUs, NVLink, shared memory and both containers' processes).

Kept by a topology spread constraint on `kubernetes.io/hostname` (maxSkew 1, DoNotSchedule) with
`minDomains` = the job's pod count, not by required pod anti-affinity. Both keep one pod of the job a node:
while the job has placed fewer pods than there are nodes its pods may use, some such node holds none of them
(skew 0), so a second pod on a node would make a skew of 2; and with fewer such nodes than pods, `minDomains`
counts the lowest as 0 all the same, so the pods that do not fit stay Pending as with anti-affinity. Pods
being deleted do not count (anti-affinity counted them until they were gone).

Why not anti-affinity: kube-scheduler's cost of a required anti-affinity term grows with the pods already
placed (InterPodAffinity's PreFilter walks them). With 4000 pods of 1000 jobs on 4000 8-GPU nodes
(`python -m bench.scale.scheduler_only`, docs/benchmarks.md "1000 jobs") all were bound in 579.7 s with it,
428.8 s with this constraint (425.9 s with no term at all); the constraint's PreFilter costs as much a pod
but does not grow, and a pod with a constraint of its own skips the default spreading the job's headless
Service brings to pod 0. A job of one pod needs none.
"""

from __future__ import annotations

from typing import Any

from colocate_operator import names
from colocate_operator.constants import COMPONENT_WORKER
from colocate_operator.spec import ColocateJob

HOSTNAME = "kubernetes.io/hostname"


def one_pod_per_node(job: ColocateJob) -> dict[str, Any]:
    """The pod spec fields that keep the job's worker pods on separate nodes (none for a job of one pod)."""
    count = job.spec.num_nodes
    if count < 2:
        return {}
    constraint = {
        "maxSkew": 1,
        "topologyKey": HOSTNAME,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": names.selector(job.ref.name, COMPONENT_WORKER)},
        "minDomains": count,
    }
    return {"topologySpreadConstraints": [constraint]}
