"""Suspend at a step boundary, decided purely: each branch of the drain (a sync in flight waits, a requested
checkpoint is awaited and acknowledged, the grace period runs out), what status and Events say, and resume."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decide import CheckpointWrite, Plan
from colocate_operator.observed import CheckpointState, Observed
from colocate_operator.status import status_patch
from colocate_operator.steps import StepTracker
from colocate_runtime.contract.events import StepEvent
from tests.operator import factories
from tests.operator.test_decide import NOW, cond, run, running_observed, running_status, ts

GRACE = 60


def suspended_job(grace: int = GRACE) -> Any:
    return factories.job(suspend=True, runPolicy={"suspendGracePeriodSeconds": grace})


def syncing(phase: str = "Copying", last: int = 7) -> dict[str, Any]:
    return running_status(weightSync={"lastCompletedStep": last, "currentPhase": phase})


def registered(*acks: tuple[str, str, int], ranks: tuple[str, ...] = ("0", "1"), request: str | None = None):
    return CheckpointState(
        readable=True,
        ranks=frozenset(ranks),
        request_id=request,
        acks={rank: (ack_id, step) for rank, ack_id, step in acks},
    )


def with_checkpoint(state: CheckpointState | None) -> Observed:
    return replace(running_observed(), checkpoint=state)


def after(plan: Plan, status: dict[str, Any]) -> dict[str, Any]:
    """The status the next pass reads: the plan's merge patch over the old one (the follower's keys stay)."""
    merged = {**status, **status_patch(status, plan.status)}
    return {key: value for key, value in merged.items() if value is not None}


def test_a_sync_in_flight_holds_the_pods_until_it_finishes() -> None:
    job = suspended_job()
    plan = run(syncing("Copying"), running_observed(), job)
    assert plan.deletes == ()
    assert plan.status["phase"] == Phase.SUSPENDING and plan.persist_first
    assert plan.status["suspension"] == {"requestTime": ts()}
    waiting = cond(plan, Cond.SUSPENDED)
    assert (waiting["status"], waiting["reason"]) == ("False", Reason.WAITING_FOR_CHECKPOINT)
    assert (
        "sync in flight (step 8) is in phase Copying" in waiting["message"]
        and ts(GRACE) in waiting["message"]
    )
    assert [e.reason for e in plan.events] == [Reason.SUSPENDING]
    assert plan.checkpoint is None, "no trainer registered: nothing to request"
    assert 0 < (plan.requeue_after or 0) <= 2.0

    # Still copying 10 s later: still waiting, the grace period counted from the first pass, no new Event.
    later = run(after(plan, syncing("Copying")), running_observed(), job, now=NOW + timedelta(seconds=10))
    assert later.deletes == () and later.events == () and not later.persist_first
    assert later.status["suspension"]["requestTime"] == ts()

    # The step's finished record reached status: the pods go, after that step.
    done = after(plan, syncing("Rollout", last=8))
    gone = run(done, running_observed(), job, now=NOW + timedelta(seconds=12))
    assert {d.name for d in gone.deletes} == {"demo-0", "demo-1"} and gone.persist_first
    assert gone.status["phase"] == Phase.SUSPENDED
    assert gone.status["suspension"] == {"requestTime": ts(), "outcome": "SyncFinished", "afterStep": 8}
    assert "after step 8" in cond(gone, Cond.SUSPENDED)["message"]
    assert [(e.type, e.reason) for e in gone.events] == [("Normal", Reason.SUSPENDED_BY_USER)]
    assert "after step 8" in gone.events[0].message


def test_a_registered_trainer_gets_a_request_and_its_ack_deletes_the_pods() -> None:
    job = suspended_job()
    status = syncing("Publishing", last=7)
    first = run(status, with_checkpoint(registered()), job)
    assert first.deletes == () and first.status["phase"] == Phase.SUSPENDING
    assert first.checkpoint == CheckpointWrite(
        request_id=ts(), reason="ColocateJob ns/demo suspended (spec.suspend)"
    )
    assert first.status["suspension"] == {"requestTime": ts(), "checkpointRequested": True}
    assert "0/2 trainer ranks acknowledged" in cond(first, Cond.SUSPENDED)["message"]

    # The request is in the store; one rank answered (an ACK of an older request does not count).
    state = registered(("0", ts(), 8), ("1", "an-older-suspension", 3), request=ts())
    second = run(after(first, status), with_checkpoint(state), job, now=NOW + timedelta(seconds=5))
    assert second.deletes == () and second.checkpoint is None, "the request is not written twice"
    assert "1/2 trainer ranks acknowledged" in cond(second, Cond.SUSPENDED)["message"]

    state = registered(("0", ts(), 8), ("1", ts(), 8), request=ts())
    third = run(after(first, status), with_checkpoint(state), job, now=NOW + timedelta(seconds=6))
    assert {d.name for d in third.deletes} == {"demo-0", "demo-1"}
    assert third.status["suspension"] == {
        "requestTime": ts(),
        "checkpointRequested": True,
        "outcome": "Checkpointed",
        "checkpointStep": 8,
        "afterStep": 8,
    }
    message = cond(third, Cond.SUSPENDED)["message"]
    assert "pods deleted after step 8 (the trainer checkpointed after step 8)" in message
    assert "checkpointed after step 8" in third.events[0].message

    # Settled: the same words every pass, nothing to patch, no Event.
    settled = run(
        after(third, status), Observed(children=running_observed().children, metastore_ready=True), job
    )
    assert settled.deletes == () and settled.events == ()
    assert settled.status["suspension"] == third.status["suspension"]
    assert cond(settled, Cond.SUSPENDED)["message"] == message
    again = run(
        after(settled, status), Observed(children=running_observed().children, metastore_ready=True), job
    )
    assert status_patch(after(settled, status), again.status) == {}


def test_the_grace_period_ends_the_wait_and_says_so() -> None:
    job = suspended_job(grace=30)
    status = syncing("Copying", last=7)
    first = run(status, with_checkpoint(registered()), job)
    assert first.requeue_after is not None
    late = run(
        after(first, status),
        with_checkpoint(registered(("0", ts(), 7), request=ts())),
        job,
        now=NOW + timedelta(seconds=30),
    )
    assert {d.name for d in late.deletes} == {"demo-0", "demo-1"}
    assert late.status["suspension"]["outcome"] == "GracePeriodExpired"
    assert late.status["suspension"]["afterStep"] == 7
    assert "checkpointStep" not in late.status["suspension"]
    message = cond(late, Cond.SUSPENDED)["message"]
    assert "after step 7" in message and "grace period ran out before the trainer acknowledged" in message
    assert [e.type for e in late.events] == ["Warning"]


def test_the_wait_wakes_up_at_the_grace_period_end() -> None:
    job = suspended_job(grace=30)
    status = after(run(syncing(), running_observed(), job), syncing())
    plan = run(status, running_observed(), job, now=NOW + timedelta(seconds=29, milliseconds=500))
    assert plan.deletes == () and plan.requeue_after == 0.5


def test_an_unreadable_store_waits_only_for_the_sync_status_shows() -> None:
    job = suspended_job()
    unreadable = with_checkpoint(CheckpointState(readable=False))
    plan = run(syncing("Copying"), unreadable, job)
    assert plan.deletes == () and plan.checkpoint is None
    assert "the meta-store did not answer" in cond(plan, Cond.SUSPENDED)["message"]
    idle = run(running_status(), unreadable, job)
    assert idle.deletes and idle.status["suspension"]["outcome"] == "SyncFinished"


def test_grace_zero_and_no_running_pods_delete_at_once() -> None:
    immediate = run(syncing("Copying"), with_checkpoint(registered()), suspended_job(grace=0))
    assert immediate.deletes and immediate.status["suspension"]["outcome"] == "Immediate"
    assert immediate.checkpoint is None
    pending = replace(
        running_observed(), pods=tuple(replace(p, phase="Pending") for p in running_observed().pods)
    )
    plan = run(syncing("Copying"), pending, suspended_job())
    assert plan.deletes and plan.status["suspension"]["outcome"] == "NoRunningPods"


def test_resume_withdraws_the_request_and_restores_the_resume_step_before_pods() -> None:
    suspension = {
        "requestTime": ts(-100),
        "checkpointRequested": True,
        "outcome": "Checkpointed",
        "checkpointStep": 8,
        "afterStep": 8,
    }
    status = {"phase": Phase.SUSPENDED, "restarts": 0, "groupCreated": False, "suspension": suspension}
    observed = Observed(children=running_observed().children, metastore_ready=True)
    plan = run(status, observed, factories.job())
    assert plan.checkpoint == CheckpointWrite(withdraw=True, resume_step=8)
    assert len([m for m in plan.creates if m["kind"] == "Pod"]) == 2
    assert plan.status["suspension"] == suspension, "the last suspension stays in status after the resume"
    assert Reason.RESUMED in [e.reason for e in plan.events]
    # A suspension that requested nothing has nothing to withdraw.
    quiet = run({**status, "suspension": {"requestTime": ts(-100), "outcome": "SyncFinished"}}, observed)
    assert quiet.checkpoint is None


def test_a_withdraw_that_failed_is_asked_again_and_status_says_why_the_pods_wait() -> None:
    """Issue 30, item 5: the executor holds back the pods while the withdraw fails (reconciler.py); decide
    asks for it again, says why in the Suspended condition, and posts Resumed only once."""
    suspension = {"requestTime": ts(-100), "checkpointRequested": True, "outcome": "GracePeriodExpired"}
    status = {"phase": Phase.SUSPENDED, "restarts": 0, "groupCreated": False, "suspension": suspension}
    error = "checkpoint request of default/demo: Secret default/demo-metastore has no key 'password'"
    observed = Observed(
        children=running_observed().children, metastore_ready=True, checkpoint_write_error=error
    )
    plan = run(status, observed, factories.job())
    assert plan.checkpoint == CheckpointWrite(withdraw=True, resume_step=None)
    suspended = cond(plan, Cond.SUSPENDED)
    assert (suspended["status"], suspended["reason"]) == ("False", Reason.CHECKPOINT_REQUEST_NOT_WITHDRAWN)
    assert error in suspended["message"]
    assert Reason.RESUMED not in [e.reason for e in plan.events]


def test_a_suspend_called_off_while_waiting_withdraws_the_request_and_keeps_the_pods() -> None:
    status = {
        **syncing(),
        "phase": Phase.SUSPENDING,
        "suspension": {"requestTime": ts(), "checkpointRequested": True},
    }
    plan = run(status, running_observed(), factories.job())
    assert plan.deletes == () and plan.status["phase"] == Phase.RUNNING
    assert plan.checkpoint == CheckpointWrite(withdraw=True, resume_step=None)
    assert cond(plan, Cond.SUSPENDED)["status"] == "False"


def test_the_step_follower_does_not_count_steps_a_resumed_trainer_redoes() -> None:
    """After a suspend past step 8, a resumed trainer (a new incarnation) that restarts from an older
    checkpoint redoes steps 7 and 8: they are not new steps; step 9 is."""
    tracker = StepTracker(expected_gpus=1)

    def finished(step: int, gen: int) -> bool:
        event = StepEvent(
            role="trainer", gen=gen, step=step, phase="finished", result="ok", gpu="GPU-a", ts=step
        )
        return tracker.observe(event)

    assert all(finished(step, gen=1) for step in range(1, 9))
    assert not finished(7, gen=2) and not finished(8, gen=2)
    assert tracker.last_completed_step == 8
    assert finished(9, gen=2) and tracker.last_completed_step == 9


def test_an_ack_counts_when_the_trainer_exited_right_after_it() -> None:
    status = {**syncing("Rollout", last=8), "phase": Phase.SUSPENDING, "suspension": {"requestTime": ts()}}
    exited = replace(
        running_observed(),
        pods=tuple(replace(p, phase="Succeeded") for p in running_observed().pods),
        checkpoint=registered(("0", ts(), 8), ("1", ts(), 8), request=ts()),
    )
    plan = run(status, exited, suspended_job(), now=NOW + timedelta(seconds=3))
    assert plan.status["suspension"]["outcome"] == "Checkpointed"
    assert plan.status["suspension"]["checkpointStep"] == 8


def test_a_paused_job_is_never_stalled_and_its_deadline_counts_again_from_the_resume() -> None:
    tracker = StepTracker(expected_gpus=1, last_progress_ts=1000.0)
    assert tracker.stalled(1000.0 + 3601, 3600)
    tracker.pause(True, 1100.0)
    assert not tracker.stalled(1000.0 + 7200, 3600), "suspended for two hours: not stalled"
    tracker.pause(True, 5000.0)  # every check while suspended keeps the first pause
    assert tracker.paused_since == 1100.0
    tracker.pause(False, 9000.0)  # resumed
    assert not tracker.stalled(9000.0 + 3599, 3600) and tracker.stalled(9000.0 + 3601, 3600)
