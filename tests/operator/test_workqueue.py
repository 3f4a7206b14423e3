"""The reconcile work queue, the event filter and the known-facts cache: pure in-process behaviour."""

from __future__ import annotations

import threading

from colocate_operator.known import KnownFacts
from colocate_operator.marks import EventMarks
from colocate_operator.observed import ClaimState
from colocate_operator.workqueue import WorkQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_queued_once_however_often_it_is_added() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ["a", "b", "a", "a", "b"]:
        queue.add(key)
    assert [queue.get(timeout=0), queue.get(timeout=0), queue.get(timeout=0)] == ["a", "b", None]


def test_a_key_added_while_processed_is_handed_out_again_after_done_never_twice_at_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add("a")  # an event while the pass runs
    assert queue.get(timeout=0) is None, "no second worker may take a key that is being processed"
    queue.done("a")
    assert queue.get(timeout=0) == "a"
    queue.done("a")
    assert queue.get(timeout=0) is None


def test_delayed_adds_keep_the_earliest_and_can_be_forgotten() -> None:
    clock = FakeClock()
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    queue.add_after("a", 30)
    queue.add_after("a", 5)  # earlier: replaces
    queue.add_after("a", 60)  # later: ignored
    queue.add_after("b", 10)
    assert queue.get(timeout=0) is None
    clock.now += 5
    assert queue.get(timeout=0) == "a"
    queue.done("a")
    clock.now += 100
    assert queue.get(timeout=0) == "b", "the superseded 30 s and 60 s entries of a are dropped"
    assert queue.get(timeout=0) is None
    queue.add_after("c", 1)
    queue.forget("c")
    clock.now += 2
    assert queue.get(timeout=0) is None


def test_a_delayed_key_due_while_processed_waits_for_done() -> None:
    clock = FakeClock()
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add_after("a", 1)
    clock.now += 2
    assert queue.get(timeout=0) is None
    queue.done("a")
    assert queue.get(timeout=0) == "a"


def test_a_waiting_worker_wakes_for_a_new_key_and_for_close() -> None:
    queue: WorkQueue[str] = WorkQueue()
    got: list[str | None] = []
    first = threading.Event()

    def worker() -> None:
        got.append(queue.get(timeout=10))
        first.set()
        got.append(queue.get(timeout=10))

    thread = threading.Thread(target=worker)
    thread.start()
    queue.add("a")
    assert first.wait(10)
    queue.close()
    thread.join(10)
    assert not thread.is_alive()
    assert got == ["a", None]


def pod(uid: str, phase: str = "Pending", node: str | None = None, rv: str = "1") -> dict:
    return {
        "metadata": {"uid": uid, "name": "p", "resourceVersion": rv},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def test_only_pod_events_that_change_a_decision_input_pass_the_filter() -> None:
    marks = EventMarks()
    assert marks.pod_changed(None, pod("u1"))  # first sight (the operator's initial listing)
    assert not marks.pod_changed("MODIFIED", pod("u1", rv="2")), "a new resourceVersion alone is no change"
    assert marks.pod_changed("MODIFIED", pod("u1", node="n1", rv="3"))
    assert marks.pod_changed("MODIFIED", pod("u1", "Running", node="n1", rv="4"))
    assert not marks.pod_changed("MODIFIED", pod("u1", "Running", node="n1", rv="5"))
    assert marks.pod_changed("DELETED", pod("u1", "Running", node="n1"))
    assert marks.pod_changed("ADDED", pod("u1")), "forgotten after deletion"


def job(generation: int, labels: dict[str, str] | None = None, status: dict | None = None) -> dict:
    return {
        "metadata": {"uid": "j1", "generation": generation, "labels": labels or {}},
        "status": status or {},
    }


def test_job_status_writes_do_not_queue_a_pass_spec_and_label_changes_do() -> None:
    marks = EventMarks()
    assert marks.job_changed(None, "ns", "a", job(1))
    assert not marks.job_changed("MODIFIED", "ns", "a", job(1, status={"phase": "Running"}))
    assert marks.job_changed("MODIFIED", "ns", "a", job(2))
    assert marks.job_changed("MODIFIED", "ns", "a", job(2, {"kueue.x-k8s.io/queue-name": "q"}))
    assert marks.job_changed("DELETED", "ns", "a", job(2))
    assert marks.metastore_changed(None, {"metadata": {"uid": "d"}, "status": {}})
    assert not marks.metastore_changed("MODIFIED", {"metadata": {"uid": "d"}, "status": {"replicas": 1}})
    assert marks.metastore_changed("MODIFIED", {"metadata": {"uid": "d"}, "status": {"readyReplicas": 1}})


def test_known_children_expire_after_the_resync_interval_and_claims_keep_only_allocated_ones() -> None:
    clock = FakeClock()
    known = KnownFacts(max_age=120, clock=clock)
    known.saw_children("uid", ["Service/a"])
    clock.now += 60
    known.saw_children("uid", ["Secret/b"])
    assert known.children("uid") == {"Service/a", "Secret/b"}
    assert known.children("other") == frozenset()
    clock.now += 61
    assert known.children("uid") == {"Secret/b"}, "read again once older than the resync interval"
    known.lost_child("uid", "Secret/b")
    assert known.children("uid") == frozenset()
    known.saw_claims("uid", {"c1": ClaimState("c1", True, ("pool/gpu-0",)), "c2": ClaimState("c2", False)})
    assert list(known.claims("uid")) == ["c1"]
    known.forget("uid")
    assert known.claims("uid") == {} and len(known) == 0
