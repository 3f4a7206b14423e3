"""The pod creation gate (pod_gate.py) on its own: the first check that holds the pods back wins."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from colocate_operator import metastore
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Reason
from colocate_operator.decision import Pass
from colocate_operator.observed import CreateRefusal, Observed, PodState
from colocate_operator.pod_gate import NAME_TAKEN_RECHECK, GateInputs, gate
from colocate_operator.status import JobStatus, StatusView
from tests.operator import factories

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
CONFIG = OperatorConfig()


def a_pass(status: dict[str, object] | None = None, observed: Observed | None = None, **job: object) -> Pass:
    view = StatusView(status or {})
    desired = JobStatus(restarts=view.restarts, group_created=view.group_created)
    return Pass(factories.job(**job), view, observed or Observed(), NOW, CONFIG, desired)


def inputs(p: Pass, **override: object) -> GateInputs:
    fields: dict[str, object] = {
        "current": [],
        "stale": [],
        "store": metastore.endpoint(p.job, CONFIG),
        "kueue_hold": False,
        "name_taken": "",
        "secret_ours": True,
    }
    return GateInputs(**(fields | override))  # type: ignore[arg-type]


def old_pod() -> PodState:
    return PodState("demo-0", "old", 0, 0, True, "Running", True, True, True)


def test_nothing_holds_a_new_group_back_so_its_pods_are_created() -> None:
    p = a_pass()
    made = gate(p, inputs(p))
    assert [m["metadata"]["name"] for m in made.creates] == ["demo-0", "demo-1"]
    assert made.condition is None and made.requeue == 1.0
    assert p.desired.start_time is not None and [e.reason for e in p.events] == [Reason.CREATED_PODS]


def test_old_pods_come_before_every_other_reason() -> None:
    p = a_pass({"restarts": 1, "lastRestartTime": "2026-11-30T12:00:00Z"}, runPolicy={"backoffSeconds": 60})
    held = gate(p, inputs(p, stale=[old_pod()], kueue_hold=True, name_taken="x"))
    assert held.condition is not None and held.condition.reason == Reason.WAITING_FOR_OLD_PODS
    assert held.creates == []


def test_a_restart_waits_for_its_backoff_then_kueue_then_a_taken_name() -> None:
    status = {"restarts": 1, "lastRestartTime": "2026-11-30T12:00:00Z"}
    p = a_pass(status, runPolicy={"backoffSeconds": 60})
    held = gate(p, inputs(p, kueue_hold=True))
    assert held.condition is not None and held.condition.reason == Reason.WAITING_FOR_BACKOFF
    assert held.requeue == 60.0
    p = a_pass(status, runPolicy={"backoffSeconds": 0})
    held = gate(p, inputs(p, kueue_hold=True, name_taken="Service ns/demo exists"))
    assert held.condition is not None and held.condition.reason == Reason.QUEUED_BY_KUEUE
    held = gate(p, inputs(p, name_taken="Service ns/demo exists"))
    assert held.condition is not None and held.condition.reason == Reason.NAME_TAKEN
    assert held.requeue == NAME_TAKEN_RECHECK


def test_a_refused_pod_create_waits_for_its_backoff_then_is_tried_again_saying_so() -> None:
    refusal = CreateRefusal("Pod", "demo-0", 1, NOW - timedelta(seconds=2), "quota exceeded")
    p = a_pass(observed=Observed(create_refusals=(refusal,)))
    held = gate(p, inputs(p))
    assert held.condition is not None and held.condition.reason == Reason.CREATE_REFUSED
    assert held.creates == [] and held.requeue == 3.0
    later = a_pass(observed=Observed(create_refusals=(refusal,)))
    later.now = NOW + timedelta(seconds=10)
    retried = gate(later, inputs(later))
    assert retried.condition is not None and retried.condition.reason == Reason.CREATE_REFUSED
    assert len(retried.creates) == 2


def test_a_whole_group_marks_itself_created_and_creates_nothing() -> None:
    p = a_pass()
    pods = [PodState(f"demo-{i}", f"u{i}", i, 0, True, "Running", False, True, True) for i in range(2)]
    made = gate(p, inputs(p, current=pods))
    assert (made.condition, made.creates, p.desired.group_created) == (None, [], True)
