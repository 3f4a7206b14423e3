"""The step follower's Events and their throttles (step_events.py): StepCompleted once a minute per job and
within the operator-wide budget; failures never held back."""

from __future__ import annotations

from typing import Any

from colocate_operator.step_events import post_step_events
from colocate_operator.step_writes import StatusWrites, SuccessEventBudget
from colocate_operator.steps import StepRecord


class RecordingApi:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def create(self, kind: Any, namespace: str, body: dict[str, Any]) -> None:
        self.reasons.append(body["reason"])


def job(name: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}"},
        "apiVersion": "v",
        "kind": "k",
    }


def test_the_budget_allows_its_burst_then_its_rate() -> None:
    budget = SuccessEventBudget(rate=2.0, burst=3.0)
    assert [budget.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert budget.take(100.4) is False  # 0.8 of a token back
    assert budget.take(100.5) is True
    assert [budget.take(200.0) for _ in range(4)] == [True, True, True, False]  # refilled up to the burst


def test_successes_beyond_the_budget_wait_for_a_later_write_and_failures_never_do() -> None:
    api, budget = RecordingApi(), SuccessEventBudget(rate=1.0, burst=2.0)
    writes = {name: StatusWrites() for name in "abc"}
    done = StepRecord(7, "Succeeded", 0.5, 100, 1000.0, "7")
    for name in "abc":
        post_step_events(api, job(name), done, writes[name], False, 1000.0, budget)  # type: ignore[arg-type]
    assert api.reasons == ["StepCompleted", "StepCompleted"]
    assert writes["c"].last_posted is None  # not posted: its next write tries again
    post_step_events(api, job("c"), done, writes["c"], False, 1001.0, budget)  # type: ignore[arg-type]
    assert api.reasons[-1] == "StepCompleted" and writes["c"].last_posted == (7, "Succeeded")
    failed = StepRecord(8, "Failed", 0.5, 100, 1001.0, "8", message="timeout on GPU 0")
    post_step_events(api, job("a"), failed, writes["a"], False, 1001.0, budget)  # type: ignore[arg-type]
    assert api.reasons[-1] == "StepFailed" and budget.tokens < 1.0
