"""The worker pods' own watch (podwatch.py) on the real control plane: a worker pod's changes and its
deletion reach the index and queue its job; other pods of the namespace never reach it (the API server
filters them out)."""

from __future__ import annotations

import threading
import time

import pytest

from colocate_devcluster import Cluster
from colocate_operator import kube
from colocate_operator.indexes import Indexes
from colocate_operator.podevents import decode_list
from colocate_operator.podwatch import PodWatch
from tests.kube import wait_for

pytestmark = pytest.mark.integration


def _pod(name: str, component: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"colocate.dev/job": "demo", "colocate.dev/component": component},
        },
        "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}], "nodeName": "missing-node"},
    }


def test_worker_pod_events_feed_the_index_and_queue_the_job(cluster: Cluster, namespace: str) -> None:
    api = kube.Kube.from_environment()
    indexes = Indexes(max_age=120)
    indexes.ready = True
    queued: list[tuple[str, str]] = []
    stop = threading.Event()
    watch = PodWatch(api, indexes, lambda ns, job: queued.append((ns, job)), [namespace])
    assert not indexes.pods_listed
    watch.start(stop)
    try:
        wait_for(lambda: indexes.pods_listed, 30, "the pod watch's first listing")
        api.create(kube.PODS, namespace, _pod("demo-0", "worker"))
        api.create(kube.PODS, namespace, _pod("redis-0", "metastore"))
        pods = wait_for(lambda: indexes.pods(namespace, "demo", ""), 30, "the worker pod in the index")
        assert [p.name for p in pods] == ["demo-0"] and (namespace, "demo") in queued
        queued.clear()
        api.delete(kube.PODS, namespace, "demo-0", grace_seconds=0)
        wait_for(lambda: indexes.pods(namespace, "demo", "") == (), 30, "the worker pod's deletion")
        assert (namespace, "demo") in queued
        # The metastore pod (same job label) was created before the deletion: had the watch received it,
        # the index would hold it now.
        assert indexes.pods(namespace, "demo", "") == ()
    finally:
        stop.set()


def test_the_watch_goes_on_across_the_end_of_each_watch_request(
    cluster: Cluster, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each watch request ends after `watch_seconds` (the API server closes it); the next one starts from
    the last resourceVersion seen, without a warning and without missing a pod created in between."""
    api = kube.Kube.from_environment()
    indexes = Indexes(max_age=120)
    indexes.ready = True
    stop = threading.Event()
    watch = PodWatch(api, indexes, lambda ns, job: None, [namespace], watch_seconds=1)
    watch.start(stop)
    try:
        wait_for(lambda: indexes.pods_listed, 30, "the pod watch's first listing")
        for i in range(3):
            time.sleep(1.5)  # past the end of the current watch request
            api.create(kube.PODS, namespace, _pod(f"demo-{i}", "worker"))
        pods = wait_for(
            lambda: (
                len(indexes.pods(namespace, "demo", "") or ()) == 3 and indexes.pods(namespace, "demo", "")
            ),
            30,
            "three worker pods through several watch requests",
        )
        assert [p.name for p in pods] == ["demo-0", "demo-1", "demo-2"]
        assert not [r for r in caplog.records if r.name == "colocate_operator.podwatch"], caplog.text
    finally:
        stop.set()


def test_a_list_in_pages_holds_every_pod_at_one_point_in_time_reduced_to_its_decision_fields(
    cluster: Cluster, namespace: str
) -> None:
    api = kube.Kube.from_environment()
    for i in range(5):
        api.create(kube.PODS, namespace, _pod(f"demo-{i}", "worker"))
    pages = list(
        api.list_pages(kube.PODS, namespace, "colocate.dev/component=worker", page=2, parse=decode_list)
    )
    assert [len(items) for items, _ in pages] == [2, 2, 1]
    assert len({version for _, version in pages}) == 1, "every page from the first page's point in time"
    names = sorted(p["metadata"]["name"] for items, _ in pages for p in items)
    assert names == [f"demo-{i}" for i in range(5)]
    first = pages[0][0][0]
    assert "managedFields" not in first["metadata"] and "image" not in first["spec"]["containers"][0]
    items, version = api.list_at(kube.SERVICES, namespace, "colocate.dev/job", page=1, metadata_only=True)
    assert items == [] and version
