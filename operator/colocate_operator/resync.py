"""The resync's reads for many jobs at once: a few lists per namespace instead of reads per job.

A pass trusts its watch-fed view of a job and the children it saw only for the resync interval (indexes.py,
known.py): after that it reads them again, which is what finds a child deleted behind the operator's back or
a deletion the watch missed. Done job by job, that is a GET of the job, a LIST of its pods and a GET of each
Service, NetworkPolicy and PodDisruptionBudget: five requests a job every interval (at 1000 jobs, 40 a second
for ever, and four more a job during a bring-up longer than the interval). Here the resync thread lists, per
namespace, the jobs, their worker pods and those three child kinds carrying a job label (metadata only), all
in pages, and hands them to the indexes and the known children as a pass's own reads would; the passes it then
queues find their jobs fresh. A child the lists do not hold is not marked seen, so its job's pass reads it
and re-creates it, as before. Secrets, Deployments and claim templates stay per job: the operator may not
list Secrets (least privilege), and only some jobs have the others.

The lists are made beside running passes, so they never vouch for a write of ours they could predate
(`Indexes.listed_job`, `Indexes.listed_pods`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from urllib3.exceptions import HTTPError

from colocate_operator import kube
from colocate_operator.constants import LABEL_JOB
from colocate_operator.indexes import Indexes
from colocate_operator.known import KnownFacts
from colocate_operator.podevents import decode_list
from colocate_operator.podwatch import LIST_PAGE, WORKER_SELECTOR

log = logging.getLogger("colocate_operator.resync")

JobKey = tuple[str, str]  # (namespace, name)
# Items a response: bounds what one reply holds in memory (a job with its status is several KB of JSON).
JOB_PAGE = 100
CHILD_PAGE = 1000  # metadata only
CHILD_KINDS = (
    (kube.SERVICES, "Service"),
    (kube.NETWORK_POLICIES, "NetworkPolicy"),
    (kube.DISRUPTION_BUDGETS, "PodDisruptionBudget"),
)


def by_namespace(jobs: Mapping[JobKey, str]) -> dict[str, dict[str, str]]:
    """{namespace: {job name: uid}}."""
    grouped: dict[str, dict[str, str]] = defaultdict(dict)
    for (namespace, name), uid in jobs.items():
        grouped[namespace][name] = uid
    return dict(grouped)


def owned_children(
    items: Iterable[Mapping[str, Any]], kind_name: str, uids: set[str]
) -> dict[str, list[str]]:
    """{job uid: [Kind/name]} of the listed objects whose owner reference names one of `uids`."""
    owned: dict[str, list[str]] = defaultdict(list)
    for item in items:
        meta = item.get("metadata") or {}
        for ref in meta.get("ownerReferences") or []:
            if ref.get("uid") in uids:
                owned[ref["uid"]].append(f"{kind_name}/{meta.get('name', '')}")
    return dict(owned)


def pods_by_job(pods: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    grouped: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for pod in pods:
        job = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)
        if job:
            grouped[job].append(pod)
    return dict(grouped)


def refresh(api: kube.Kube, indexes: Indexes, known: KnownFacts, jobs: Mapping[JobKey, str]) -> int:
    """Read every namespace's jobs, worker pods and listable children at once; returns the requests sent.
    A namespace whose lists fail is left to its jobs' own reads."""
    requests = 0
    for namespace, uids in by_namespace(jobs).items():
        try:
            requests += _refresh_namespace(api, indexes, known, namespace, uids)
        except (kube.KubeError, HTTPError, OSError) as e:
            log.warning("resync lists of namespace %s failed (its jobs read their own): %s", namespace, e)
    return requests


def _refresh_namespace(
    api: kube.Kube, indexes: Indexes, known: KnownFacts, namespace: str, uids: Mapping[str, str]
) -> int:
    requests = 0
    listed: set[str] = set()  # jobs the list holds under the uid this process knows
    # Page by page: the index keeps each job without managedFields, so no page outlives its handling.
    for bodies, _ in api.list_pages(kube.COLOCATE_JOBS, namespace, page=JOB_PAGE):
        requests += 1
        for body in bodies:
            indexes.listed_job(body)
            meta = body.get("metadata") or {}
            if uids.get(meta.get("name", "")) == meta.get("uid"):
                listed.add(meta["name"])
    pods: list[Mapping[str, Any]] = []
    at = None
    # Each pod reduced to its decision fields while it is parsed (podevents.py): 4000 whole pods are hundreds
    # of megabytes as Python objects.
    worker_pages = api.list_pages(kube.PODS, namespace, WORKER_SELECTOR, page=LIST_PAGE, parse=decode_list)
    for page, version in worker_pages:
        requests += 1
        pods += page
        at = version
    grouped = pods_by_job(pods)
    # A job the list lacks (deleted, or deleted and created again, while the watch was down) is not
    # refreshed: its view stays stale, so its pass reads it and finds it gone.
    for name in listed:
        indexes.listed_pods(namespace, name, grouped.get(name, []), at)
    wanted = {uids[name] for name in listed}
    for kind, kind_name in CHILD_KINDS:
        for items, _ in api.list_pages(kind, namespace, LABEL_JOB, page=CHILD_PAGE, metadata_only=True):
            requests += 1
            for uid, children in owned_children(items, kind_name, wanted).items():
                known.saw_children(uid, children)
    return requests
