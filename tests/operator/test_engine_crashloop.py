"""Issue 30 item 7, the pure part: SGLang restarting in place more often in one group than
runPolicy.maxEngineRestarts allows is a crash loop: the group restarts (EngineCrashLooping, one of
maxRestarts), and with those used the job ends Failed, never Running forever."""

from __future__ import annotations

from dataclasses import replace

from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.observed import Observed
from tests.operator import factories
from tests.operator.test_decide import INFRA, claims, cond, pod, reasons, run, running_status


def crashing(restarts_in_place: tuple[int, int], group: int = 0) -> Observed:
    pods = tuple(
        replace(
            pod(i, group, ready=True),
            engine_restarts=n,
            engine_ready=n == 0,
            engine_last_exit_code=139 if n else None,
            engine_restart_in_place=True,
        )
        for i, n in enumerate(restarts_in_place)
    )
    return Observed(pods=pods, children=INFRA, metastore_ready=True, claims=claims(0, 1))


def test_restarts_in_place_within_the_budget_keep_the_group() -> None:
    job = factories.job(runPolicy={"maxEngineRestarts": 3})
    plan = run(running_status(), crashing((2, 1)), job)
    assert plan.status["restarts"] == 0 and not plan.deletes
    assert plan.status["phase"] == Phase.RUNNING


def test_one_more_than_the_budget_restarts_the_group_naming_the_crash_loop() -> None:
    job = factories.job(runPolicy={"maxEngineRestarts": 3, "maxRestarts": 2})
    plan = run(running_status(), crashing((3, 1)), job)
    assert plan.status["restarts"] == 1 and plan.status["phase"] == Phase.RESTARTING
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1"} and plan.persist_first
    restarting = cond(plan, Cond.RESTARTING)
    assert restarting["reason"] == Reason.ENGINE_CRASH_LOOPING
    assert "SGLang restarted in place 4 times in this group" in restarting["message"]
    assert "spec.runPolicy.maxEngineRestarts=3" in restarting["message"]
    assert "demo-0: 3 restarts, last exit code 139" in restarting["message"]
    assert plan.status["engineRestartsCounted"] == 0  # the new group counts from zero


def test_with_the_group_restarts_used_the_job_fails_with_the_crash_loop_as_the_reason() -> None:
    job = factories.job(runPolicy={"maxEngineRestarts": 1, "maxRestarts": 1})
    status = running_status(restarts=1, engineRestarts=2, engineRestartsCounted=0)
    plan = run(status, crashing((2, 0), group=1), job)
    assert plan.status["phase"] == Phase.FAILED
    failed = cond(plan, Cond.FAILED)
    assert failed["reason"] == Reason.MAX_RESTARTS_EXCEEDED
    assert "maxEngineRestarts=1" in failed["message"] and "all 1 restarts used" in failed["message"]
    assert Reason.JOB_FAILED in reasons(plan)


def test_the_default_budget_is_five() -> None:
    assert factories.job().spec.run_policy.max_engine_restarts == 5
    plan = run(running_status(), crashing((5, 0)))
    assert plan.status["restarts"] == 0
    plan = run(running_status(), crashing((5, 1)))
    assert plan.status["restarts"] == 1
