"""Issue 30 item 6, the pure part: a create the API server refused (quota, admission policy) is tried again
after 5 s, 10 s, 20 s, ... at most every 5 minutes, whatever triggers the passes in between, and PodsReady
carries the API server's message meanwhile."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from colocate_operator.constants import Cond, Reason
from colocate_operator.decide import create_backoff
from colocate_operator.observed import CreateRefusal, Observed
from tests.operator.test_decide import INFRA, NOW, cond, created, reasons, run

QUOTA = 'pods "demo-0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=0, limited: pods=0'


def refused(attempts: int, seconds_ago: float, kind: str = "Pod", name: str = "demo-0") -> Observed:
    refusal = CreateRefusal(kind, name, attempts, NOW - timedelta(seconds=seconds_ago), QUOTA)
    return Observed(children=INFRA, metastore_ready=True, device_class_found=True, create_refusals=(refusal,))


def test_the_backoff_doubles_from_5_seconds_to_a_5_minute_cap() -> None:
    assert [create_backoff(n) for n in range(0, 9)] == [0, 5, 10, 20, 40, 80, 160, 300, 300]
    assert create_backoff(10_000) == 300


def test_refused_pods_wait_for_the_backoff_and_the_condition_carries_the_servers_message() -> None:
    plan = run({"phase": "Pending"}, refused(attempts=3, seconds_ago=4))  # backoff 20 s: 16 s to go
    assert created(plan, "Pod") == []
    assert Reason.CREATED_PODS not in reasons(plan)
    pods_ready = cond(plan, Cond.PODS_READY)
    assert pods_ready["status"] == "False" and pods_ready["reason"] == Reason.CREATE_REFUSED
    assert QUOTA in pods_ready["message"] and "3 times in a row" in pods_ready["message"]
    assert plan.requeue_after == 16


def test_once_the_backoff_ended_the_pods_are_tried_again_and_the_message_stays() -> None:
    plan = run({"phase": "Pending"}, refused(attempts=3, seconds_ago=20))
    assert created(plan, "Pod") == ["demo-0", "demo-1"]
    assert cond(plan, Cond.PODS_READY)["reason"] == Reason.CREATE_REFUSED


def test_without_a_refusal_pods_are_created_as_before() -> None:
    plan = run({"phase": "Pending"}, replace(refused(1, 0), create_refusals=()))
    assert created(plan, "Pod") == ["demo-0", "demo-1"]
    assert cond(plan, Cond.PODS_READY)["reason"] == Reason.PODS_NOT_CREATED


def test_another_kind_refused_is_held_back_until_its_backoff_ends() -> None:
    observed = replace(refused(2, 3, kind="Service", name="demo"), children=INFRA - {"Service/demo"})
    plan = run({"phase": "Pending"}, observed)
    assert created(plan, "Service") == []
    assert plan.requeue_after is not None and plan.requeue_after <= 7
    later = run({"phase": "Pending"}, observed, now=NOW + timedelta(seconds=8))
    assert created(later, "Service") == ["demo"]
