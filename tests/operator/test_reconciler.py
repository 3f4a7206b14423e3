"""The executor around `decide`, on an in-memory API: ordering, conflicts, idempotence, no secret reads."""

from __future__ import annotations

import copy
import itertools
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from colocate_operator import kube
from colocate_operator.config import OperatorConfig
from colocate_operator.indexes import Indexes
from colocate_operator.known import KnownFacts
from colocate_operator.reconciler import Reconciler
from tests.operator import factories

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


class FakeKube(kube.Kube):
    """Just enough of the API server: objects by (plural, namespace, name), resourceVersions, a call log."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.metadata_only: list[str] = []
        self.fail_create: dict[str, int] = {}  # kind plural -> HTTP status
        self.fail_list: dict[str, int] = {}  # kind plural -> HTTP status
        self.conflict_next_status_write = False
        self.deleted: list[dict[str, Any]] = []  # DELETED events the watch has not delivered yet
        self._counter = itertools.count(1)

    def _key(self, kind: kube.Kind, namespace: str | None, name: str) -> tuple[str, str | None, str]:
        return kind.plural, namespace if kind.namespaced else None, name

    def put(self, kind: kube.Kind, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._counter)}")
        meta["resourceVersion"] = str(next(self._counter))
        self.objects[self._key(kind, meta.get("namespace"), meta["name"])] = body
        return body

    def get(self, kind, namespace, name, *, metadata_only=False):
        self.calls.append(("get", kind.plural, name))
        if metadata_only:
            self.metadata_only.append(kind.plural)
        body = self.objects.get(self._key(kind, namespace, name))
        if body is None:
            return None
        return {"metadata": copy.deepcopy(body["metadata"])} if metadata_only else copy.deepcopy(body)

    def list_pages(self, kind, namespace, label_selector=None, *, page=None, metadata_only=False, parse=None):
        yield self.list_at(kind, namespace, label_selector, metadata_only=metadata_only)

    def list_at(self, kind, namespace, label_selector=None, *, page=None, metadata_only=False, parse=None):
        self.calls.append(("list", kind.plural, label_selector or ""))
        if kind.plural in self.fail_list:
            raise kube.KubeError(self.fail_list[kind.plural], "ServiceUnavailable", "try again")
        if metadata_only:
            self.metadata_only.append(kind.plural)
        parts = label_selector.split(",") if label_selector else []
        wanted = dict(part.split("=") for part in parts if "=" in part)
        present = [part for part in parts if "=" not in part]  # existence selectors
        items = [
            {"metadata": copy.deepcopy(b["metadata"])} if metadata_only else copy.deepcopy(b)
            for (plural, ns, _), b in self.objects.items()
            if plural == kind.plural
            and ns == namespace
            and all(b["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            and all(k in b["metadata"].get("labels", {}) for k in present)
        ]
        return items, str(next(self._counter))

    def create(self, kind, namespace, body):
        self.calls.append(("create", kind.plural, body["metadata"].get("name", "")))
        if kind.plural in self.fail_create:
            raise kube.KubeError(self.fail_create[kind.plural], "Forbidden", "not allowed")
        body = copy.deepcopy(body)
        if kind.plural == "events":
            body["metadata"]["name"] = f"event-{next(self._counter)}"
        if self._key(kind, namespace, body["metadata"]["name"]) in self.objects:
            raise kube.KubeError(409, "AlreadyExists", "exists")
        return self.put(kind, body)["metadata"]["resourceVersion"]

    def delete(self, kind, namespace, name, *, uid=None):
        self.calls.append(("delete", kind.plural, name))
        gone = self.objects.pop(self._key(kind, namespace, name), None)
        if gone is None:
            return None
        gone["metadata"]["resourceVersion"] = str(next(self._counter))
        self.deleted.append(gone)
        return gone["metadata"]["resourceVersion"]

    def patch(self, kind, namespace, name, patch, *, subresource=None):
        self.calls.append(("patch", f"{kind.plural}/{subresource}", name))
        body = self.objects[self._key(kind, namespace, name)]
        expected = patch.get("metadata", {}).get("resourceVersion")
        if self.conflict_next_status_write or (expected and expected != body["metadata"]["resourceVersion"]):
            self.conflict_next_status_write = False
            raise kube.KubeError(409, "Conflict", "the object has been modified")
        status = body.setdefault("status", {})
        for key, value in patch.get("status", {}).items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value
        body["metadata"]["resourceVersion"] = str(next(self._counter))
        return body["metadata"]["resourceVersion"]

    # Test helpers.
    def job(self) -> dict[str, Any]:
        return self.objects[("colocatejobs", "ns", "demo")]

    def pods(self) -> list[dict[str, Any]]:
        return [b for (plural, _, _), b in self.objects.items() if plural == "pods"]

    def touch(self, body: dict[str, Any]) -> None:
        """A change by someone else (kubelet, scheduler): a new resourceVersion, as the API server gives."""
        body["metadata"]["resourceVersion"] = str(next(self._counter))

    def run_pods(self) -> None:
        """What the scheduler, the claim controller and kwok do, in one step."""
        for pod in self.pods():
            pod["spec"]["nodeName"] = f"gpu-node-{pod['metadata']['labels']['colocate.dev/replica-index']}"
            pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
            self.touch(pod)
        deployment = self.objects[("deployments", "ns", "demo-metastore")]
        deployment["status"] = {"readyReplicas": 1}

    def event_reasons(self) -> list[str]:
        return [b["reason"] for (plural, _, _), b in self.objects.items() if plural == "events"]

    def deliver(self, indexes: Indexes) -> None:
        """What kopf's index and event handlers do once the watch has caught up with every change."""
        indexes.ready = True
        for (plural, _, _), body in self.objects.items():
            if plural == "colocatejobs":
                indexes.saw_job(copy.deepcopy(body))
            elif plural == "pods":
                indexes.saw_pod(copy.deepcopy(body))
        for body in self.deleted:
            if "labels" in body["metadata"]:
                indexes.pod_gone(body)
        self.deleted.clear()


@pytest.fixture
def api() -> FakeKube:
    fake = FakeKube()
    fake.put(kube.COLOCATE_JOBS, factories.body())
    fake.put(kube.DEVICE_CLASSES, {"metadata": {"name": "gpu.nvidia.com"}})
    return fake


@pytest.fixture
def reconciler(api: FakeKube) -> Reconciler:
    reconciler = Reconciler(api, OperatorConfig(), clock=lambda: NOW)
    reconciler._schedule = lambda *args: None  # type: ignore[method-assign]  # no background requeues here
    return reconciler


@pytest.fixture
def known_clock(reconciler: Reconciler) -> list[float]:
    """The clock of what the reconciler remembers between passes (resync interval 120 s); advance it."""
    now = [0.0]
    reconciler.known = KnownFacts(max_age=120, clock=lambda: now[0])
    return now


def bring_up(api: FakeKube, reconciler: Reconciler) -> None:
    reconciler.reconcile("ns", "demo")
    api.run_pods()
    reconciler.reconcile("ns", "demo")
    assert api.job()["status"]["phase"] == "Running"


def test_bring_up_and_idle_passes_write_nothing(api: FakeKube, reconciler: Reconciler) -> None:
    bring_up(api, reconciler)
    assert len(api.pods()) == 2
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert [c for c in api.calls if c[0] in ("create", "delete", "patch")] == []


def test_a_bring_up_neither_reads_nor_creates_the_budget_before_the_gang_is_ready(
    api: FakeKube, reconciler: Reconciler
) -> None:
    reconciler.reconcile("ns", "demo")
    reconciler.reconcile("ns", "demo")  # pods created, not running: the job has status, no budget yet
    budget_calls = [c for c in api.calls if c[1] == "poddisruptionbudgets"]
    assert budget_calls == [], "no 404 read of a budget not wanted yet"
    api.run_pods()
    reconciler.reconcile("ns", "demo")
    assert [c for c in api.calls if c[1] == "poddisruptionbudgets"] == [
        ("create", "poddisruptionbudgets", "demo-workers")
    ]
    assert api.job()["status"]["phase"] == "Running"


def test_secret_data_is_never_read(api: FakeKube, reconciler: Reconciler, known_clock: list[float]) -> None:
    bring_up(api, reconciler)
    known_clock[0] += 121  # the resync's pass reads every child again
    reconciler.reconcile("ns", "demo")
    secret_reads = [c for c in api.calls if c[:2] == ("get", "secrets")]
    assert secret_reads and api.metadata_only.count("secrets") == len(secret_reads)


def test_restart_is_persisted_before_pods_are_deleted(api: FakeKube, reconciler: Reconciler) -> None:
    bring_up(api, reconciler)
    api.pods()[1]["status"]["phase"] = "Failed"
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    writes = [c for c in api.calls if c[0] in ("patch", "delete")]
    assert writes[0] == ("patch", "colocatejobs/status", "demo")
    assert sorted(c[2] for c in writes[1:]) == ["demo-0", "demo-1"]
    assert api.job()["status"]["restarts"] == 1
    assert "RestartingGroup" in api.event_reasons()


def test_conflicting_status_write_defers_the_deletion(api: FakeKube, reconciler: Reconciler) -> None:
    bring_up(api, reconciler)
    api.pods()[0]["status"]["phase"] = "Failed"
    api.conflict_next_status_write = True
    api.calls.clear()
    reconciler._pass("ns", "demo")
    assert not [c for c in api.calls if c[0] == "delete"], "no deletion without the persisted restart"
    assert api.job()["status"]["restarts"] == 0
    reconciler._pass("ns", "demo")  # the retry decides again from fresh state
    assert api.job()["status"]["restarts"] == 1
    assert api.pods() == []


def test_create_failures_are_reported_once_and_retried_after_a_backoff(
    api: FakeKube, reconciler: Reconciler
) -> None:
    now = [NOW]
    reconciler.clock = lambda: now[0]
    api.fail_create["networkpolicies"] = 403
    assert reconciler._pass("ns", "demo") == 5.0
    reconciler._pass("ns", "demo")  # within the 5 s backoff: not tried again (issue 30, item 6)
    assert api.calls.count(("create", "networkpolicies", "demo-metastore")) == 1
    now[0] += timedelta(seconds=5)
    assert reconciler._pass("ns", "demo") == 10.0  # refused twice in a row: 10 s
    # Once per object: the meta-store's and the workers' NetworkPolicy.
    assert api.event_reasons().count("FailedToCreate") == 2
    assert api.calls.count(("create", "networkpolicies", "demo-metastore")) == 2
    del api.fail_create["networkpolicies"]
    now[0] += timedelta(seconds=10)
    reconciler._pass("ns", "demo")
    assert ("networkpolicies", "ns", "demo-metastore") in api.objects
    assert ("networkpolicies", "ns", "demo-workers") in api.objects


def test_deleted_job_is_forgotten(api: FakeKube, reconciler: Reconciler) -> None:
    reconciler.reconcile("ns", "demo")
    assert reconciler.known_jobs() == [("ns", "demo")]
    del api.objects[("colocatejobs", "ns", "demo")]
    reconciler.reconcile("ns", "demo")
    assert reconciler.known_jobs() == []


def test_event_driven_passes_skip_children_already_seen_until_the_resync_interval(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float]
) -> None:
    bring_up(api, reconciler)
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    reads = sorted(c[:2] for c in api.calls if c[0] in ("get", "list"))
    # The job, its pods and the meta-store's readiness: the only things an event can have changed.
    assert reads == [("get", "colocatejobs"), ("get", "deployments"), ("list", "pods")]
    known_clock[0] += 121
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    kinds = {c[1] for c in api.calls if c[0] == "get"}
    children = {"services", "secrets", "networkpolicies", "poddisruptionbudgets", "resourceclaimtemplates"}
    assert children <= kinds


def test_a_child_deleted_behind_the_operators_back_is_recreated_by_the_resync(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float]
) -> None:
    bring_up(api, reconciler)
    del api.objects[("services", "ns", "demo")]
    reconciler.reconcile("ns", "demo")
    assert ("services", "ns", "demo") not in api.objects, "an event-driven pass trusts what it saw"
    known_clock[0] += 121
    reconciler.reconcile("ns", "demo")
    assert ("services", "ns", "demo") in api.objects


def test_a_new_job_creates_its_children_without_reading_them_first(
    api: FakeKube, reconciler: Reconciler
) -> None:
    api.put(kube.SERVICES, {"metadata": {"name": "demo", "namespace": "ns"}})  # someone else's, same name
    reconciler.reconcile("ns", "demo")
    child_reads = [c for c in api.calls if c[0] == "get" and c[1] not in ("colocatejobs", "deviceclasses")]
    assert child_reads == [], "a job without status has no children of its own yet"
    assert ("create", "services", "demo") in api.calls  # answered 409: it exists
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert ("get", "services", "demo") in api.calls, "the next pass looks at what answered 409"


def test_a_taken_secret_name_holds_back_redis_and_the_pods(api: FakeKube, reconciler: Reconciler) -> None:
    """The first pass creates without reading; the predecessor's Secret (still being collected) answers
    409. Redis and the pods must not start on it; the next pass names it in a condition, creates nothing."""
    old = {"name": "demo-metastore-auth", "namespace": "ns", "deletionTimestamp": "2026-11-30T11:59:00Z"}
    old["ownerReferences"] = [{"kind": "ColocateJob", "name": "demo", "uid": "uid-old", "controller": True}]
    api.put(kube.SECRETS, {"metadata": old, "data": {"password": "b2xk"}})
    reconciler._pass("ns", "demo")
    created = [c[1] for c in api.calls if c[0] == "create" and c[1] != "events"]
    assert created[0] == "secrets"
    assert "deployments" not in created and "pods" not in created
    api.calls.clear()
    reconciler._pass("ns", "demo")
    assert [c for c in api.calls if c[0] == "create" and c[1] != "events"] == []
    meta = next(c for c in api.job()["status"]["conditions"] if c["type"] == "MetaStoreReady")
    assert meta["reason"] == "NameTaken"
    assert (
        "Secret ns/demo-metastore-auth exists, owned by ColocateJob demo (being deleted)" in meta["message"]
    )
    assert api.event_reasons().count("NameTaken") == 1
    # Collected: this job's Secret, Redis and pods, in that order.
    del api.objects[("secrets", "ns", "demo-metastore-auth")]
    api.calls.clear()
    reconciler._pass("ns", "demo")
    created = [c[1] for c in api.calls if c[0] == "create" and c[1] != "events"]
    assert created[0] == "secrets" and "deployments" in created and created.count("pods") == 2
    owner = api.objects[("secrets", "ns", "demo-metastore-auth")]["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-demo"


def test_a_pod_name_taken_is_read_back_and_reported_once(api: FakeKube, reconciler: Reconciler) -> None:
    api.put(kube.PODS, {"metadata": {"name": "demo-1", "namespace": "ns"}, "spec": {}})
    for _ in range(4):
        reconciler._pass("ns", "demo")
    assert api.calls.count(("create", "pods", "demo-1")) == 1, "not retried every pass"
    ready = next(c for c in api.job()["status"]["conditions"] if c["type"] == "PodsReady")
    assert (ready["reason"], "Pod ns/demo-1 exists, not owned by this job" in ready["message"]) == (
        "NameTaken",
        True,
    )
    assert api.event_reasons().count("NameTaken") == 1
    assert api.event_reasons().count("CreatedPods") == 1


def test_a_stuck_pod_is_deleted_with_grace_zero(api: FakeKube, reconciler: Reconciler) -> None:
    bring_up(api, reconciler)
    pod = api.pods()[0]
    pod["metadata"]["deletionTimestamp"] = "2026-11-30T11:50:00Z"  # ten minutes past its grace period
    deletes: list[tuple[str, int | None]] = []
    real_delete = api.delete

    def delete(kind, namespace, name, *, uid=None, grace_seconds=None):
        deletes.append((name, grace_seconds))
        return real_delete(kind, namespace, name, uid=uid)

    api.delete = delete  # type: ignore[method-assign]
    reconciler._pass("ns", "demo")
    assert ("demo-0", 0) in deletes
    assert "ForceDeletedPod" in api.event_reasons()


def test_a_pod_exit_waits_for_the_follower_to_catch_up(api: FakeKube, reconciler: Reconciler) -> None:
    """M4: the operator restarted as the training ended; its follower has not read the stream yet."""
    from colocate_operator.observed import StreamProgress

    bring_up(api, reconciler)
    progress = StreamProgress()
    reconciler.stream_progress = lambda ns, name: progress
    for pod in api.pods():
        pod["status"]["phase"] = "Succeeded"
    assert reconciler._pass("ns", "demo") == pytest.approx(1.0)
    assert api.job()["status"]["restarts"] == 0 and len(api.pods()) == 2
    ready = next(c for c in api.job()["status"]["conditions"] if c["type"] == "PodsReady")
    assert ready["reason"] == "WaitingForFinalRecord"
    progress.final = True  # the follower replayed the stream and found the final record
    reconciler._pass("ns", "demo")
    assert api.job()["status"]["phase"] == "Succeeded" and api.job()["status"]["restarts"] == 0


def test_a_pod_exit_without_the_final_record_restarts_once_the_stream_is_read(
    api: FakeKube, reconciler: Reconciler
) -> None:
    from colocate_operator.observed import StreamProgress

    bring_up(api, reconciler)
    progress = StreamProgress(caught_up_at=time.time() - 5)  # reading, last at the end before the exit
    reconciler.stream_progress = lambda ns, name: progress
    for pod in api.pods():
        pod["status"]["phase"] = "Succeeded"
    reconciler._pass("ns", "demo")
    assert api.job()["status"]["restarts"] == 0
    progress.caught_up_at = time.time() + 1
    reconciler._pass("ns", "demo")
    assert api.job()["status"]["restarts"] == 1


# Watch-fed indexes ---------------------------------------------------------------------------------------


def job_and_pod_reads(api: FakeKube) -> list[tuple[str, str]]:
    return [c[:2] for c in api.calls if c[:2] in (("get", "colocatejobs"), ("list", "pods"))]


@pytest.fixture
def index_clock(reconciler: Reconciler) -> list[float]:
    now = [0.0]
    reconciler.indexes = Indexes(max_age=120, clock=lambda: now[0])
    return now


def test_event_driven_passes_read_the_job_and_its_pods_from_the_watch(
    api: FakeKube, reconciler: Reconciler
) -> None:
    api.deliver(reconciler.indexes)
    reconciler.reconcile("ns", "demo")
    api.deliver(reconciler.indexes)  # the watch shows the status written and the pods created
    api.run_pods()
    api.deliver(reconciler.indexes)
    reconciler.reconcile("ns", "demo")
    assert api.job()["status"]["phase"] == "Running"
    assert job_and_pod_reads(api) == []


def test_a_view_older_than_the_passs_own_writes_is_read_fresh(api: FakeKube, reconciler: Reconciler) -> None:
    api.deliver(reconciler.indexes)
    reconciler.reconcile("ns", "demo")  # writes status and creates the pods; the watch has shown neither
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert job_and_pod_reads(api) == [("get", "colocatejobs"), ("list", "pods")]
    assert not [c for c in api.calls if c[0] == "create" and c[1] != "events"], "nothing created twice"
    wrote = ("patch", "colocatejobs/status", "demo") in api.calls
    api.calls.clear()
    reconciler.reconcile("ns", "demo")  # what was read fresh replaced the older view
    assert job_and_pod_reads(api) == ([("get", "colocatejobs")] if wrote else []), "only what it wrote since"


def test_pods_deleted_for_a_restart_are_not_taken_from_an_older_view(
    api: FakeKube, reconciler: Reconciler
) -> None:
    api.deliver(reconciler.indexes)
    bring_up(api, reconciler)
    api.deliver(reconciler.indexes)
    pod = api.pods()[1]
    pod["status"]["phase"] = "Failed"
    api.touch(pod)
    api.deliver(reconciler.indexes)
    reconciler.reconcile("ns", "demo")  # persists the restart, deletes both pods
    assert api.job()["status"]["restarts"] == 1 and api.pods() == []
    api.calls.clear()
    reconciler.reconcile("ns", "demo")  # the watch still shows both pods, older than the deletions
    assert ("list", "pods") in job_and_pod_reads(api)
    assert not [c for c in api.calls if c[0] == "delete"]
    assert reconciler.indexes.pods("ns", "demo", "uid-demo") == (), "the fresh list replaced the view"


def test_a_deletion_the_watch_missed_is_found_by_the_resync_read(
    api: FakeKube, reconciler: Reconciler, index_clock: list[float]
) -> None:
    api.deliver(reconciler.indexes)
    bring_up(api, reconciler)
    api.deliver(reconciler.indexes)
    del api.objects[("pods", "ns", "demo-1")]  # while kopf's watch was down: no DELETED event
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert job_and_pod_reads(api) == [] and api.job()["status"]["restarts"] == 0
    index_clock[0] += 121
    reconciler.reconcile("ns", "demo")
    assert job_and_pod_reads(api) == [("get", "colocatejobs"), ("list", "pods")]
    assert api.job()["status"]["restarts"] == 1, "the lost pod counts as lost"


def test_a_status_conflict_is_decided_again_from_a_fresh_read(api: FakeKube, reconciler: Reconciler) -> None:
    api.deliver(reconciler.indexes)
    bring_up(api, reconciler)
    api.deliver(reconciler.indexes)
    pod = api.pods()[0]
    pod["status"]["phase"] = "Failed"
    api.touch(pod)
    api.deliver(reconciler.indexes)
    api.touch(api.job())  # someone else (the step follower) wrote status; the watch has not shown it yet
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert not [c for c in api.calls if c[0] == "delete"]
    reconciler.reconcile("ns", "demo")
    assert ("get", "colocatejobs") in job_and_pod_reads(api)
    assert api.job()["status"]["restarts"] == 1


def test_the_resync_reads_a_namespace_with_a_few_lists_and_its_passes_read_nothing_listed(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float], index_clock: list[float]
) -> None:
    api.put(kube.COLOCATE_JOBS, factories.body(name="other"))
    api.deliver(reconciler.indexes)
    for name in ("demo", "other"):
        reconciler.reconcile("ns", name)
    api.run_pods()
    api.deliver(reconciler.indexes)
    for name in ("demo", "other"):
        reconciler.reconcile("ns", name)
    api.deliver(reconciler.indexes)
    known_clock[0] += 121
    index_clock[0] += 121
    api.calls.clear()
    api.metadata_only.clear()
    reconciler.resync_once()
    lists = sorted(c[1] for c in api.calls if c[0] == "list")
    assert lists == ["colocatejobs", "networkpolicies", "poddisruptionbudgets", "pods", "services"]
    assert [c for c in api.calls if c[0] != "list"] == [], "lists only"
    assert sorted(api.metadata_only) == [
        "networkpolicies",
        "poddisruptionbudgets",
        "services",
    ]
    api.calls.clear()
    for name in ("demo", "other"):
        reconciler.reconcile("ns", name)
    reads = sorted({c[:2] for c in api.calls if c[0] in ("get", "list")})
    # Left to each pass: the meta-store's readiness, its Secret (never listed: least privilege) and the
    # claim template of a job on DRA (only some jobs have one).
    assert reads == [("get", "deployments"), ("get", "resourceclaimtemplates"), ("get", "secrets")]


def running_then_stale(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float], index_clock: list[float]
) -> None:
    """A running job the watch has shown, then the resync interval passes."""
    api.deliver(reconciler.indexes)
    bring_up(api, reconciler)
    api.deliver(reconciler.indexes)
    known_clock[0] += 121
    index_clock[0] += 121


def test_a_child_deleted_behind_the_operators_back_is_recreated_after_the_resync_lists(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float], index_clock: list[float]
) -> None:
    running_then_stale(api, reconciler, known_clock, index_clock)
    del api.objects[("services", "ns", "demo")]
    del api.objects[("pods", "ns", "demo-1")]  # while the watch was down: no DELETED event
    reconciler.resync_once()
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert ("get", "services", "demo") in api.calls, "not in the list: read by name"
    assert ("services", "ns", "demo") in api.objects, "and created again"
    assert api.job()["status"]["restarts"] == 1, "the pod the list no longer holds counts as lost"
    assert ("list", "pods") not in {c[:2] for c in api.calls}, "the resync's list stands for the pass's"


def test_a_failed_resync_list_leaves_the_reads_to_each_pass(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float], index_clock: list[float]
) -> None:
    running_then_stale(api, reconciler, known_clock, index_clock)
    api.fail_list["pods"] = 503
    reconciler.resync_once()  # logs and goes on
    del api.fail_list["pods"]
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert ("list", "pods") in {c[:2] for c in api.calls}
    assert ("get", "services", "demo") in api.calls


def test_a_job_deleted_while_the_watch_was_down_is_not_refreshed_by_the_resync(
    api: FakeKube, reconciler: Reconciler, known_clock: list[float], index_clock: list[float]
) -> None:
    running_then_stale(api, reconciler, known_clock, index_clock)
    del api.objects[("colocatejobs", "ns", "demo")]  # no DELETED event: the watch was down
    reconciler.resync_once()
    assert reconciler.indexes.job("ns", "demo") is None, "the list lacks it: still stale"
    api.calls.clear()
    reconciler.reconcile("ns", "demo")
    assert ("get", "colocatejobs", "demo") in api.calls
    assert reconciler.known_jobs() == [], "found gone and forgotten"
    assert not [c for c in api.calls if c[0] == "create" and c[1] != "events"], "nothing created for it"


def test_a_resume_whose_withdraw_fails_creates_the_stores_secret_but_no_pod(
    api: FakeKube, reconciler: Reconciler
) -> None:
    """Issue 30, item 5: the withdraw used to run first and raise, so the Secret deleted while the job was
    suspended was never created again. Now only the pods wait; the phase stays Suspended (the next pass
    withdraws again) and the Suspended condition says why."""
    bring_up(api, reconciler)
    for key in [k for k in api.objects if k[0] == "pods"]:
        del api.objects[key]
    job = api.job()
    job["status"].update(
        phase="Suspended",
        groupCreated=False,
        suspension={"requestTime": "2026-01-01T00:00:00Z", "checkpointRequested": True},
    )
    api.touch(job)
    del api.objects[("secrets", "ns", "demo-metastore-auth")]
    reconciler.reconcile("ns", "demo")  # the withdraw fails: no Secret to read the password from
    reconciler.reconcile("ns", "demo")  # the Secret is read again, and created
    assert ("secrets", "ns", "demo-metastore-auth") in api.objects
    assert api.pods() == [], "no pod before the request is withdrawn"
    status = api.job()["status"]
    assert status["phase"] == "Suspended"
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (
        suspended["reason"] == "CheckpointRequestNotWithdrawn"
        and "demo-metastore-auth" in suspended["message"]
    )


def test_pods_held_back_behind_a_taken_name_are_announced_once_by_the_pass_that_creates_them(
    api: FakeKube, reconciler: Reconciler
) -> None:
    """A replica (or an operator before its restart) died after creating the Service: the next one's first
    pass finds the name taken and holds the pods back; only the pass that creates them posts CreatedPods
    (issue 30, item 10: it came twice after a leader change)."""
    uid = api.objects[("colocatejobs", "ns", "demo")]["metadata"]["uid"]
    owner = [{"apiVersion": "colocate.dev/v1alpha1", "kind": "ColocateJob", "name": "demo", "uid": uid}]
    api.put(kube.SERVICES, {"metadata": {"name": "demo", "namespace": "ns", "ownerReferences": owner}})
    reconciler._pass("ns", "demo")
    assert not [c for c in api.calls if c[:2] == ("create", "pods")]
    assert "CreatedPods" not in api.event_reasons()
    reconciler._pass("ns", "demo")
    assert [c[2] for c in api.calls if c[:2] == ("create", "pods")] == ["demo-0", "demo-1"]
    assert api.event_reasons().count("CreatedPods") == 1
