"""The watch-fed indexes alone: newer events only, deletions by uid, our writes make older views stale."""

from __future__ import annotations

from typing import Any

from colocate_operator.indexes import Indexes, reduced_job

JOB_UID = "uid-demo"


def pod(name: str, rv: int, phase: str = "Pending", uid: str | None = None, owner: str = JOB_UID) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(rv),
            "labels": {"colocate.dev/job": "demo", "colocate.dev/component": "worker"},
            "ownerReferences": [{"uid": owner, "controller": True, "kind": "ColocateJob", "name": "demo"}],
        },
        "spec": {},
        "status": {"phase": phase},
    }


def job(rv: int, uid: str = JOB_UID, **status: Any) -> dict:
    meta = {"name": "demo", "namespace": "ns", "uid": uid, "resourceVersion": str(rv)}
    meta["managedFields"] = [{"manager": "x", "fieldsV1": {"f:status": {}}}]
    return {"apiVersion": "colocate.dev/v1alpha1", "kind": "ColocateJob", "metadata": meta, "status": status}


def ready() -> Indexes:
    indexes = Indexes(max_age=120, clock=lambda: 0.0)
    indexes.ready = True
    return indexes


def test_nothing_is_served_before_kopf_has_filled_the_indexes() -> None:
    indexes = Indexes(max_age=120)
    indexes.saw_job(job(5))
    assert indexes.job("ns", "demo") is None and indexes.pods("ns", "demo", JOB_UID) is None


def test_only_a_newer_event_replaces_an_entry_and_only_a_change_of_facts_counts() -> None:
    indexes = ready()
    assert indexes.saw_pod(pod("demo-0", 10, "Running"))
    assert not indexes.saw_pod(pod("demo-0", 9, "Pending")), "a late event of an older version"
    assert not indexes.saw_pod(pod("demo-0", 11, "Running")), "a new version with the same facts"
    assert [p.phase for p in indexes.pods("ns", "demo", JOB_UID) or ()] == ["Running"]
    indexes.saw_job(job(20, phase="Running"))
    indexes.saw_job(job(19, phase="Pending"))
    body = indexes.job("ns", "demo")
    assert body is not None and body["status"]["phase"] == "Running"
    assert "managedFields" not in body["metadata"] and body == reduced_job(job(20, phase="Running"))


def test_ownership_is_decided_against_the_job_that_asks() -> None:
    indexes = ready()
    indexes.saw_pod(pod("demo-0", 10, owner="uid-old"))
    (state,) = indexes.pods("ns", "demo", JOB_UID) or ()
    assert not state.owned
    (state,) = indexes.pods("ns", "demo", "uid-old") or ()
    assert state.owned


def test_a_deletion_event_of_the_predecessor_spares_the_job_recreated_under_its_name() -> None:
    indexes = ready()
    indexes.saw_job(job(30, uid="uid-new"))
    indexes.job_gone("ns", "demo", "uid-old")
    assert indexes.job("ns", "demo") is not None
    indexes.job_gone("ns", "demo", "uid-new")
    assert indexes.job("ns", "demo") is None


def test_our_writes_make_older_views_stale_until_the_watch_shows_them() -> None:
    indexes = ready()
    indexes.saw_job(job(10))
    indexes.saw_pod(pod("demo-0", 11))
    indexes.wrote_status("ns", "demo", "15")
    indexes.created_pod("ns", "demo", "demo-1", "14")
    indexes.deleted_pod("ns", "demo", "uid-demo-0", "16")
    assert indexes.job("ns", "demo") is None and indexes.pods("ns", "demo", JOB_UID) is None
    indexes.saw_job(job(15))
    indexes.saw_pod(pod("demo-1", 14))
    assert indexes.job("ns", "demo") is not None
    assert indexes.pods("ns", "demo", JOB_UID) is None, "the deleted pod is still shown as it was"
    indexes.pod_gone(pod("demo-0", 16))
    assert [p.name for p in indexes.pods("ns", "demo", JOB_UID) or ()] == ["demo-1"]
    assert not indexes.saw_pod(pod("demo-0", 12)), "a late event of the deleted pod brings nothing back"


def test_an_answer_without_a_version_makes_the_view_stale_until_a_fresh_read() -> None:
    indexes = ready()
    indexes.saw_job(job(10))
    indexes.wrote_status("ns", "demo", None)
    indexes.saw_job(job(99))
    assert indexes.job("ns", "demo") is None
    indexes.read_job(job(100))
    assert indexes.job("ns", "demo") is not None


def test_a_fresh_list_drops_pods_the_watch_never_reported_gone() -> None:
    now = [0.0]
    indexes = Indexes(max_age=120, clock=lambda: now[0])
    indexes.ready = True
    indexes.saw_job(job(10))
    indexes.saw_pod(pod("demo-0", 11))
    indexes.saw_pod(pod("demo-1", 12))
    now[0] = 121
    assert indexes.job("ns", "demo") is None and indexes.pods("ns", "demo", JOB_UID) is None, "due a read"
    indexes.read_job(job(10))
    indexes.read_pods("ns", "demo", [pod("demo-1", 12)], "40")
    assert [p.name for p in indexes.pods("ns", "demo", JOB_UID) or ()] == ["demo-1"]
    assert indexes.job("ns", "demo") is not None


def test_a_relist_keeps_the_listed_pods_and_drops_those_deleted_while_the_watch_was_down() -> None:
    """podwatch.py lists again after its watch expired (410): a pod the list lacks was deleted meanwhile,
    and no DELETED event will come for it; a pod newer than the list stays."""
    indexes = ready()
    indexes.saw_pod(pod("demo-0", 10, "Running"))
    indexes.saw_pod(pod("demo-1", 11, "Running"))
    indexes.saw_pod(pod("demo-2", 40, "Pending"))  # created after the list below was taken
    changed = indexes.relisted_pods(lambda ns: ns == "ns", [pod("demo-0", 30, "Succeeded")], "35")
    assert changed == {("ns", "demo")}
    assert [(p.name, p.phase) for p in indexes.pods("ns", "demo", JOB_UID) or ()] == [
        ("demo-0", "Succeeded"),
        ("demo-2", "Pending"),
    ]
    assert not indexes.saw_pod(pod("demo-1", 12, "Running")), "a late event of the pod the list dropped"
    assert indexes.relisted_pods(lambda ns: ns == "other", [], "50") == set(), "another namespace's relist"


def test_pods_wait_for_the_pod_watch_to_list_once() -> None:
    indexes = ready()
    indexes.pods_listed = False
    indexes.saw_pod(pod("demo-0", 10))
    assert indexes.pods("ns", "demo", JOB_UID) is None
    indexes.pods_listed = True
    assert indexes.pods("ns", "demo", JOB_UID) is not None


def test_a_resync_list_never_vouches_for_a_write_of_ours_it_may_predate() -> None:
    """The resync lists beside running passes: a create or status write answered after the list's point in
    time stays unseen until the watch shows it, where a pass's own list (read_pods) vouches for all."""
    indexes = ready()
    indexes.saw_job(job(10))
    indexes.saw_pod(pod("demo-0", 11))
    indexes.created_pod("ns", "demo", "demo-1", "30")  # answered after the list below was made
    indexes.wrote_status("ns", "demo", "31")
    indexes.listed_pods("ns", "demo", [pod("demo-0", 11)], "20")
    indexes.listed_job(job(20))
    assert indexes.pods("ns", "demo", JOB_UID) is None, "demo-1 is newer than the list"
    assert indexes.job("ns", "demo") is None, "our status write is newer than the listed job"
    indexes.saw_pod(pod("demo-1", 30))
    indexes.saw_job(job(31))
    assert [p.name for p in indexes.pods("ns", "demo", JOB_UID) or ()] == ["demo-0", "demo-1"]
    assert indexes.job("ns", "demo") is not None
    indexes.created_pod("ns", "demo", "demo-2", "40")
    indexes.read_pods("ns", "demo", [pod("demo-0", 11), pod("demo-1", 30)], "35")
    assert indexes.pods("ns", "demo", JOB_UID) is not None, "a pass's own list holds every write before it"


def test_a_resync_list_drops_a_pod_it_no_longer_holds_and_refreshes_the_view() -> None:
    now = [0.0]
    indexes = Indexes(max_age=120, clock=lambda: now[0])
    indexes.ready = True
    indexes.pods_listed = True
    indexes.saw_job(job(10))
    indexes.saw_pod(pod("demo-0", 11))
    indexes.saw_pod(pod("demo-1", 12))
    now[0] = 121
    assert indexes.pods("ns", "demo", JOB_UID) is None, "older than the resync interval"
    indexes.listed_pods("ns", "demo", [pod("demo-0", 11)], "50")  # demo-1 deleted while the watch was down
    assert [p.name for p in indexes.pods("ns", "demo", JOB_UID) or ()] == ["demo-0"]
