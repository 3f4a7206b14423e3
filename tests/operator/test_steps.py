"""Step events -> weight-sync status, without a cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from colocate_operator import steps
from colocate_operator.constants import IPC_PREFLIGHT_FAILURES, Cond, Reason
from colocate_operator.status import CONDITION_OWNERS, STEP_KEYS, Owner, step_patch
from colocate_operator.steps import StepTracker, step_conditions
from colocate_runtime.contract import events as ev
from colocate_runtime.contract.events import StepEvent


def weight_sync(tracker: StepTracker) -> dict[str, Any]:
    """status.weightSync as the follower writes it."""
    return written(tracker)["weightSync"]


def recent_steps(tracker: StepTracker) -> list[dict[str, Any]]:
    return written(tracker)["recentSteps"]


def written(tracker: StepTracker) -> dict[str, Any]:
    return step_patch(
        tracker.weight_sync_status(), tracker.recent_steps_status(), [], tracker.rollout.status()
    )


def finished(
    step: int,
    gpu: str,
    *,
    gen: int = 1,
    seconds: float = 0.01,
    nbytes: int = 100,
    version: str = "",
    ts: float = 1000.0,
    result: str = "ok",
) -> StepEvent:
    return StepEvent(
        role="trainer",
        gen=gen,
        step=step,
        phase="finished",
        result=result,
        seconds=seconds,
        bytes=nbytes,
        gpu=gpu,
        weight_version=version or str(step),
        ts=ts,
    )


def test_step_completes_only_when_every_gpu_finished() -> None:
    tracker = StepTracker(expected_gpus=2)
    assert tracker.observe(finished(1, "GPU-a", seconds=0.02, nbytes=10)) is False
    assert tracker.last_completed_step is None
    assert tracker.observe(finished(1, "GPU-a")) is False  # a repeat from the same GPU counts once
    assert tracker.observe(finished(1, "GPU-b", seconds=0.05, nbytes=30, ts=1001.0)) is True
    status = weight_sync(tracker)
    assert status["lastCompletedStep"] == 1
    assert status["lastSyncSeconds"] == 0.05  # the slowest GPU bounds the step
    assert status["lastSyncBytes"] == 130
    assert [r["step"] for r in recent_steps(tracker)] == [1]
    assert recent_steps(tracker)[0]["completionTime"] == "1970-01-01T00:16:41Z"


def test_a_completed_record_completes_the_step_for_every_gpu_at_once() -> None:
    """Summary mode (runtime/colocated/step_summary.py): one record stands for the job's GPUs."""
    tracker = StepTracker(expected_gpus=32)
    assert tracker.observe(finished(1, "GPU-a")) is False  # a detailed record first: pending
    done = replace(finished(1, "", seconds=0.05, nbytes=3200, ts=1001.0), phase="completed")
    assert tracker.observe(done) is True
    status = weight_sync(tracker)
    assert (status["lastCompletedStep"], status["lastSyncSeconds"], status["lastSyncBytes"]) == (
        1,
        0.05,
        3200,
    )
    assert status["currentPhase"] == "Rollout"
    assert tracker.observe(done) is False  # a repeat (or a replay after a restart) moves nothing back
    assert tracker.observe(replace(done, step=2, result="error")) is False  # only a success completes
    assert tracker.observe(replace(done, step=2, role="reader")) is False
    assert tracker.last_completed_step == 1 and tracker.state_size()["pending_steps"] == 0


def test_intermediate_phases_update_the_phase_without_a_write() -> None:
    tracker = StepTracker(expected_gpus=1)
    event = StepEvent(role="reader", gen=1, step=3, phase="copied")
    assert tracker.observe(event) is False
    assert weight_sync(tracker) == {"currentPhase": "Copying"}


def test_history_is_bounded_and_keeps_the_newest() -> None:
    tracker = StepTracker(expected_gpus=1, history_limit=3)
    for step in range(1, 8):
        assert tracker.observe(finished(step, "g")) is True
    assert [r["step"] for r in recent_steps(tracker)] == [5, 6, 7]


def test_old_or_repeated_steps_do_not_move_status_back() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.observe(finished(5, "g"))
    assert tracker.observe(finished(4, "g")) is False
    assert tracker.observe(finished(5, "g")) is False
    assert tracker.last_completed_step == 5


def test_incarnations_are_per_gpu_and_a_restart_drops_that_gpus_pending_step() -> None:
    tracker = StepTracker(expected_gpus=2)
    # Every trainer process has its own incarnation: different gens on different GPUs complete a step.
    tracker.observe(finished(1, "a", gen=1))
    assert tracker.observe(finished(1, "b", gen=2)) is True
    tracker.observe(finished(2, "a", gen=1))
    tracker.observe(finished(2, "b", gen=3))  # b restarted: its newer incarnation reports step 2
    assert tracker.last_completed_step == 2
    assert tracker.observe(finished(3, "b", gen=2)) is False  # stale: b's old incarnation
    tracker.observe(finished(3, "b", gen=3))
    assert tracker.observe(finished(3, "a", gen=4)) is True  # a's new incarnation finishes step 3 too
    tracker.observe(finished(4, "b", gen=3))
    tracker.observe(finished(3, "b", gen=5))  # b restarted again: its pending step 4 is dropped
    assert tracker.observe(finished(4, "a", gen=4)) is False
    assert tracker.observe(finished(4, "b", gen=5)) is True


def test_failure_is_recorded_once_per_step_with_its_reason() -> None:
    tracker = StepTracker(expected_gpus=2)
    failed = StepEvent(
        role="trainer",
        gen=1,
        step=2,
        phase="failed",
        result="timeout",
        gpu="GPU-x",
        error="no ACK within 600 s",
        ts=5.0,
    )
    assert tracker.observe(failed) is True
    assert tracker.observe(failed) is False
    (record,) = recent_steps(tracker)
    assert record["result"] == "Failed" and "timeout on GPU GPU-x: no ACK" in record["message"]
    assert tracker.last_failure is not None
    tracker.observe(finished(3, "a"))
    tracker.observe(finished(3, "b"))
    assert tracker.last_failure is None  # a later good step heals the job


def test_final_record_is_what_marks_success() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.observe(finished(1, "g"))
    assert tracker.final_result is None
    assert tracker.observe(StepEvent(role="trainer", gen=1, step=1, phase="final", result="ok", final=True))
    assert tracker.final_result == "Succeeded"
    assert weight_sync(tracker)["finalStepRecorded"] is True


def test_a_final_record_with_an_error_result_is_a_failed_training_with_its_message() -> None:
    """finish(ok=False) (runtime/colocated/writer.py): phase final, result error, the trainer's message."""
    tracker = StepTracker(expected_gpus=2)
    tracker.observe(finished(1, "a"))
    error = StepEvent(
        role="trainer",
        gen=1,
        step=1,
        phase="final",
        gpu="GPU-b",
        result="error",
        final=True,
        error="loss is NaN",
    )
    assert tracker.observe(error)
    ok = StepEvent(role="trainer", gen=1, step=1, phase="final", gpu="GPU-a", result="ok", final=True)
    tracker.observe(ok)  # another rank's success does not make the run succeed
    assert tracker.final_result == "Failed"
    status = weight_sync(tracker)
    assert status["finalStepRecorded"] is True and status["finalResult"] == "Failed"
    assert status["finalMessage"] == "error on GPU GPU-b: loss is NaN"
    success = StepTracker(expected_gpus=1)
    success.observe(ok)
    assert weight_sync(success)["finalResult"] == "Succeeded" and "finalMessage" not in weight_sync(success)


def test_stalled_after_the_progress_deadline() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.observe(finished(1, "g", ts=100.0))
    assert not tracker.stalled(now=150.0, deadline_seconds=60)
    assert tracker.stalled(now=161.0, deadline_seconds=60)


def test_numeric_weight_versions_compare_as_numbers() -> None:
    tracker = StepTracker(expected_gpus=2)
    tracker.observe(finished(1, "a", version="9"))
    tracker.observe(finished(1, "b", version="10"))
    assert tracker.weight_version == "10"


def preflight(gpu: str, result: str, reason: str = "", *, gen: int = 1, ts: float = 1000.0) -> StepEvent:
    return StepEvent(
        role="trainer",
        gen=gen,
        step=0,
        phase="preflight",
        result=result,
        reason=reason,
        gpu=gpu,
        error="" if result != "error" else f"{reason} detail",
        ts=ts,
    )


def ipc(tracker: StepTracker) -> tuple[bool, str, str] | None:
    found = next((c for c in step_conditions(tracker, False, 60) if c.type == Cond.IPC_READY), None)
    return None if found is None else (found.status, found.reason, found.message)


def test_ipc_ready_needs_every_gpu_to_pass_in_its_newest_incarnation() -> None:
    tracker = StepTracker(expected_gpus=2)
    assert ipc(tracker) is None  # no preflight events (mode Off): no condition at all
    assert tracker.observe(preflight("GPU-a", "")) is True
    assert ipc(tracker) == (False, Reason.PREFLIGHT_PENDING, "0/2 GPUs passed the IPC preflight")
    assert weight_sync(tracker)["currentPhase"] == "Preflight"
    assert tracker.observe(preflight("GPU-a", "ok", ev.PREFLIGHT_PASSED)) is False  # still pending: no write
    assert ipc(tracker) == (False, Reason.PREFLIGHT_PENDING, "1/2 GPUs passed the IPC preflight")
    assert tracker.observe(preflight("GPU-b", "ok", ev.PREFLIGHT_PASSED)) is True
    assert ipc(tracker) == (True, Reason.PREFLIGHT_PASSED, "all 2 GPUs passed the IPC preflight")
    # GPU-b's trainer restarted: its new incarnation has to pass again; the old one's leftovers do not count.
    assert tracker.observe(preflight("GPU-b", "", gen=2, ts=1010.0)) is True
    assert ipc(tracker)[1] == Reason.PREFLIGHT_PENDING
    assert tracker.observe(preflight("GPU-b", "ok", ev.PREFLIGHT_PASSED, gen=1, ts=1011.0)) is False
    assert tracker.observe(preflight("GPU-b", "ok", ev.PREFLIGHT_PASSED, gen=2, ts=1012.0)) is True
    assert ipc(tracker)[0] is True


def test_ipc_failure_names_the_gpu_and_survives_wait_mode_retries_until_a_pass() -> None:
    tracker = StepTracker(expected_gpus=2)
    tracker.observe(preflight("GPU-a", "ok", ev.PREFLIGHT_PASSED))
    assert tracker.observe(preflight("GPU-b", "error", ev.SHM_NOT_SHARED)) is True
    assert ipc(tracker) == (False, Reason.SHM_NOT_SHARED, "GPU GPU-b: ShmNotShared detail")
    for ts in (1005.0, 1010.0):  # the next attempts start and fail the same way: nothing to write
        assert tracker.observe(preflight("GPU-b", "", ts=ts)) is False
        assert tracker.observe(preflight("GPU-b", "error", ev.SHM_NOT_SHARED, ts=ts)) is False
        assert ipc(tracker)[1] == Reason.SHM_NOT_SHARED
    assert tracker.observe(preflight("GPU-b", "error", ev.PEER_TIMEOUT, ts=1020.0)) is True  # reason changed
    assert tracker.observe(preflight("GPU-b", "ok", ev.PREFLIGHT_PASSED, ts=1030.0)) is True
    assert ipc(tracker)[:2] == (True, Reason.PREFLIGHT_PASSED)


def test_ipc_ready_follows_the_gpus_that_reported_last() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.observe(preflight("GPU-old", "error", ev.DEVICE_UUID_MISMATCH, ts=1000.0))
    assert ipc(tracker)[1] == Reason.DEVICE_UUID_MISMATCH
    # The group was recreated on another GPU: its report replaces the old GPU's.
    assert tracker.observe(preflight("GPU-new", "ok", ev.PREFLIGHT_PASSED, ts=2000.0)) is True
    assert ipc(tracker)[:2] == (True, Reason.PREFLIGHT_PASSED)


def test_preflight_events_outside_the_contract_are_ignored() -> None:
    tracker = StepTracker(expected_gpus=1)
    assert tracker.observe(preflight("GPU-a", "timeout")) is False
    assert tracker.observe(preflight("GPU-a", "error", "")) is False  # a failure must say why
    reader = StepEvent(
        role="reader", gen=1, step=0, phase="preflight", result="error", reason=ev.SHM_NOT_SHARED
    )
    assert tracker.observe(reader) is False  # the trainer's record counts, the reader's is detail
    assert ipc(tracker) is None


def test_operator_reasons_are_the_runtime_reasons() -> None:
    assert set(ev.PREFLIGHT_FAILURES) == IPC_PREFLIGHT_FAILURES
    assert ev.PREFLIGHT_PASSED == Reason.PREFLIGHT_PASSED
    assert {getattr(Reason, n) for n in dir(Reason) if getattr(Reason, n) in ev.PREFLIGHT_REASONS} == set(
        ev.PREFLIGHT_REASONS
    )


def test_a_follower_waits_until_the_next_decision_it_must_make_without_new_entries() -> None:
    from colocate_operator.step_follow import DECISION_MAX_WAIT_SECONDS, decision_wait
    from colocate_operator.step_writes import (
        HEARTBEAT_SECONDS,
        WRITE_MIN_INTERVAL_SECONDS,
        WRITE_SETTLE_SECONDS,
        StatusWrites,
    )

    tracker = StepTracker(expected_gpus=1)
    tracker.last_progress_ts = 1000.0
    writes = StatusWrites(written_phase=tracker.current_phase)
    # Nothing due before the cap: a long wait.
    assert decision_wait(tracker, writes, False, 600, 1000.0) == DECISION_MAX_WAIT_SECONDS
    # The progress deadline comes first: wake then to write the stall.
    assert decision_wait(tracker, writes, False, 3, 1001.0) == 2.0
    writes.written_stalled = True
    assert decision_wait(tracker, writes, False, 3, 1005.0) == DECISION_MAX_WAIT_SECONDS, "no spin"
    # A phase change not yet in status waits for the heartbeat.
    writes.written_phase, writes.last_write = "something else", 996.0
    assert decision_wait(tracker, writes, False, 3, 1005.0) == 996.0 + HEARTBEAT_SECONDS - 1005.0
    # A step boundary waits for the rest of its burst, and for the minimum interval between writes.
    writes.written_phase, writes.dirty_since = tracker.current_phase, 1005.0
    assert decision_wait(tracker, writes, True, 3, 1005.0) == WRITE_SETTLE_SECONDS
    writes.last_write = 1004.5
    assert decision_wait(tracker, writes, True, 3, 1005.0) == 1004.5 + WRITE_MIN_INTERVAL_SECONDS - 1005.0
    # A refused write is retried when its backoff ends, never in a tight loop.
    writes.retry_at = 1009.0
    assert decision_wait(tracker, writes, True, 3, 1005.0) == 4.0


def test_the_follower_writes_only_the_keys_and_conditions_it_owns() -> None:
    tracker = StepTracker(expected_gpus=1)
    tracker.observe(StepEvent(role="trainer", gen=1, step=0, phase="preflight", result="ok"))
    tracker.observe(finished(1, "g"))
    figures = ev.RolloutFigures(0.001, 0.01, 0.2, 0.0, 0.5, 64)
    tracker.observe(StepEvent(role="trainer", gen=1, step=1, phase="rollout", result="ok", rollout=figures))
    tracker.observe(StepEvent(role="trainer", gen=1, step=1, phase="final", result="ok", final=True))
    assert set(written(tracker)) == set(STEP_KEYS)
    for stalled in (False, True):
        types = {c.type for c in step_conditions(tracker, stalled, 60)}
        assert types and all(CONDITION_OWNERS[t] == Owner.STEPS for t in types)


def test_state_stays_bounded_under_a_flood_and_the_next_real_step_completes() -> None:
    """Any container of the job writes the stream: 20k distinct GPUs, steps and failures fill nothing."""
    tracker = StepTracker(expected_gpus=2, history_limit=3)
    assert tracker.observe(finished(1, "GPU-a")) is False  # a real step half done before the flood
    for i in range(20_000):
        tracker.observe(finished(1_000_000 + i, f"GPU-evil-{i}"))
        tracker.observe(
            StepEvent(role="trainer", gen=1, step=2_000_000 + i, phase="failed", result="error", gpu="GPU-x")
        )
    size = tracker.state_size()
    assert size["gpus"] <= steps.gpu_limit(2) and size["pending_steps"] <= steps.PENDING_STEPS_MAX
    assert (
        size["pending_entries"] <= steps.PENDING_STEPS_MAX and size["failed_steps"] <= steps.FAILED_STEPS_MAX
    )
    assert size["recent"] == 3 and tracker.dropped > 20_000
    # The real GPUs report the next step: it completes, whatever the flood left.
    assert tracker.observe(finished(2, "GPU-a")) is False
    assert tracker.observe(finished(2, "GPU-b")) is True
    assert tracker.last_completed_step == 2


def test_a_long_failure_message_is_cut_to_what_status_admits() -> None:
    tracker = StepTracker(expected_gpus=1)
    event = StepEvent(
        role="trainer", gen=1, step=1, phase="failed", result="error", gpu="G" * 128, error="e" * 5000
    )
    tracker.observe(event)
    record = recent_steps(tracker)[-1]
    assert len(record["message"]) <= steps.MESSAGE_MAX_CHARS
    assert all(len(c.message) <= 4096 for c in step_conditions(tracker, False, 60))
