"""Issue 30 item 10, the pure part and one elector against a fake Lease API: who may take the Lease and
when (the candidate's own clock, never the holder's renewTime), renewals, a lost lease, the release."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import urllib3

from colocate_operator import kube, leader
from colocate_operator.leader import CREATE, RENEW, TAKE, WAIT, decide_lease, observe


def lease(holder: str | None, renew: str = "t1", transitions: int = 0, duration: int = 15) -> dict[str, Any]:
    return {
        "metadata": {"name": "lease", "namespace": "ops", "resourceVersion": "7"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "renewTime": renew,
            "leaseTransitions": transitions,
        },
    }


def test_no_lease_is_created_ours_is_renewed_a_released_one_taken() -> None:
    assert decide_lease(None, None, "me", 0) == (CREATE, 0)
    held = lease("me")
    assert decide_lease(held, observe(held, None, 0), "me", 0) == (RENEW, 0)
    released = lease(None)
    assert decide_lease(released, observe(released, None, 0), "me", 0) == (TAKE, 0)


def test_anothers_lease_is_taken_only_after_it_went_unrenewed_for_its_duration() -> None:
    first = lease("other", renew="t1")
    seen = observe(first, None, 100.0)  # first read: dated now
    assert decide_lease(first, seen, "me", 100.0) == (WAIT, 15.0)
    seen = observe(first, seen, 102.0)  # unchanged: keeps its date
    assert decide_lease(first, seen, "me", 102.0) == (WAIT, 13.0)
    renewed = lease("other", renew="t2")
    seen = observe(renewed, seen, 104.0)  # changed after the read at 102: dated 102, the earliest it can be
    assert seen.since == 102.0
    assert decide_lease(renewed, seen, "me", 116.9)[0] == WAIT
    assert decide_lease(renewed, seen, "me", 117.0) == (TAKE, 0)


def test_the_holders_renew_time_is_never_trusted() -> None:
    old = lease("other", renew="2000-01-01T00:00:00.000000Z")  # a holder whose clock is far behind
    seen = observe(old, None, 50.0)
    assert decide_lease(old, seen, "me", 50.0)[0] == WAIT


def test_settings_must_order_retry_renew_and_lease() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        leader.Settings("ops", lease_duration=10, renew_deadline=10)


class FakeLeases:
    """The Lease API's optimistic concurrency: a write carrying an old resourceVersion is a 409."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.fail: bool | str = False

    def get(self, kind: kube.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        if self.fail == "refused":  # the API server restarting: urllib3's own error, not an OSError
            raise urllib3.exceptions.MaxRetryError(None, "/", "Connection refused")  # type: ignore[arg-type]
        if self.fail:
            raise kube.KubeError(503, "ServiceUnavailable", "down")
        return None if self.lease is None else {**self.lease, "metadata": {**self.lease["metadata"]}}

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return self.lease

    def create(self, kind: kube.Kind, namespace: str, body: dict[str, Any]) -> str:
        if self.lease is not None:
            raise kube.KubeError(409, "AlreadyExists", "exists")
        return self._store(body)["metadata"]["resourceVersion"]

    def replace(self, kind: kube.Kind, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.fail:
            raise kube.KubeError(503, "ServiceUnavailable", "down")
        if (
            self.lease is None
            or body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]
        ):
            raise kube.KubeError(409, "Conflict", "the object has been modified")
        return self._store(body)


def elector(api: FakeLeases, identity: str, clock: list[float], events: list[str]) -> leader.LeaderElector:
    settings = leader.Settings("ops", "lease", identity)
    return leader.LeaderElector(
        api,  # type: ignore[arg-type]
        settings,
        lambda: events.append(f"{identity} leads"),
        lambda: events.append(f"{identity} stopped"),
        clock=lambda: clock[0],
    )


def test_two_candidates_one_wins_the_other_takes_over_once_it_stops_renewing() -> None:
    api, clock, events = FakeLeases(), [0.0], []
    a, b = elector(api, "a", clock, events), elector(api, "b", clock, events)
    assert a.try_acquire_or_renew() == (True, 0)
    assert b.try_acquire_or_renew() == (False, 15.0)
    for t in (2.0, 4.0, 6.0):  # a renews, b watches the record change
        clock[0] = t
        assert a.try_acquire_or_renew()[0]
        assert not b.try_acquire_or_renew()[0]
    # a dies after its renewal at 6; b saw that one at 6 (dated at its read at 4): b takes over at 19.
    clock[0] = 18.9
    assert not b.try_acquire_or_renew()[0]
    clock[0] = 19.0
    assert b.try_acquire_or_renew() == (True, 0)
    assert api.lease is not None
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()[0]  # a, were it alive, finds b holding it


def test_a_clean_stop_releases_the_lease_for_an_immediate_takeover() -> None:
    api, clock, events = FakeLeases(), [0.0], []
    a, b = elector(api, "a", clock, events), elector(api, "b", clock, events)
    assert a.try_acquire_or_renew()[0]
    assert not b.try_acquire_or_renew()[0]
    a.release()
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] is None
    assert b.try_acquire_or_renew() == (True, 0)


def test_a_leader_that_cannot_renew_stops_at_its_renew_deadline() -> None:
    api, events = FakeLeases(), []
    settings = leader.Settings("ops", "lease", "a", lease_duration=1.5, renew_deadline=0.6, retry_period=0.05)
    stopped = threading.Event()
    a = leader.LeaderElector(
        api,  # type: ignore[arg-type]
        settings,
        lambda: events.append("leads"),
        lambda: (events.append("stopped"), stopped.set()),
    )
    stop = threading.Event()
    thread = a.start(stop)
    assert a.leading.wait(2)
    api.fail = True  # the API server stops answering
    assert stopped.wait(3), events
    assert events == ["leads", "stopped"] and not a.leading.is_set()
    stop.set()
    thread.join(2)


def test_a_standby_keeps_campaigning_through_an_api_server_restart() -> None:
    """Found by the soak: a refused connection killed the standby's election thread, so no one took over."""
    api, clock, events = FakeLeases(), [0.0], []
    a, b = elector(api, "a", clock, events), elector(api, "b", clock, events)
    assert a.try_acquire_or_renew()[0]
    api.fail = "refused"
    assert b.try_acquire_or_renew() == (False, 2.0)
    assert a.try_acquire_or_renew() == (False, 2.0)
    api.fail = False
    assert not b.try_acquire_or_renew()[0]
    clock[0] = 20.0
    assert b.try_acquire_or_renew() == (True, 0)
