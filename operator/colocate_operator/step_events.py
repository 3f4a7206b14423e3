"""The Kubernetes Events a job's step follower posts, throttled: one per failed step, StepCompleted at most
once a minute per job and within a budget shared by every job (`SuccessEventBudget`), StepStalled when the
progress deadline passes, and what the stream made it skip (entries too large to read, entries that are
not step events, state let go of) at most once a minute.
(The rollout-consistency breach Events are rollout_check.py's.)
"""

from __future__ import annotations

from typing import Any

from colocate_operator import kube
from colocate_operator.kube_events import post_event
from colocate_operator.step_stream import ENTRY_MAX_BYTES, SKIP_EVENT_INTERVAL, JobStream
from colocate_operator.step_writes import StatusWrites, SuccessEventBudget
from colocate_operator.steps import StepRecord
from colocate_runtime.contract.events import ENTRY_MAX_FIELDS, FIELD_MAX_BYTES

SUCCESS_EVENT_INTERVAL = 60.0  # StepCompleted Events per job at most this often; failures always
EVENT_MESSAGE_MAX_CHARS = 1024


def skips_due(state: JobStream, now: float) -> list[tuple[str, str]]:
    """The (reason, message) Events due now, marking them reported: `StepEntriesSkipped` for entries left
    unread for their size, `StepStreamUntrusted` for entries that are not step events and state dropped."""
    skips, dropped_total = state.skips, state.tracker.dropped
    skipped, dropped = skips.count - skips.reported_count, dropped_total - skips.reported_dropped
    oversized = skips.oversized - skips.reported_oversized
    if not (skipped or dropped or oversized) or now - skips.last_event < SKIP_EVENT_INTERVAL:
        return []
    due = []
    if oversized:
        due.append(
            (
                "StepEntriesSkipped",
                f"skipped {oversized} step-stream entries over {ENTRY_MAX_BYTES} bytes (the largest "
                f"{skips.largest} bytes) without reading them: a step event is at most {ENTRY_MAX_FIELDS} "
                f"fields of {FIELD_MAX_BYTES} bytes",
            )
        )
    parts = []
    if skipped:
        parts.append(f"skipped {skipped} step-stream entries that are not step events (last: {skips.last})")
    if dropped:
        parts.append(f"let go of {dropped} GPUs or unfinished steps beyond the follower's bounds")
    if parts:
        due.append(("StepStreamUntrusted", "; ".join(parts)))
    skips.reported_count, skips.reported_dropped, skips.last_event = skips.count, dropped_total, now
    skips.reported_oversized, skips.largest = skips.oversized, 0
    return [(reason, message[:EVENT_MESSAGE_MAX_CHARS]) for reason, message in due]


def post_step_events(
    api: kube.Kube,
    body: dict[str, Any],
    newest: StepRecord | None,
    writes: StatusWrites,
    newly_stalled: bool,
    now: float,
    budget: SuccessEventBudget | None = None,
) -> None:
    """Events at step boundaries, throttled: one per failed step, successes at most once a minute (and
    within `budget`, shared by the operator's jobs)."""
    if newly_stalled:
        post_event(
            api, body, "Warning", "StepStalled", "no weight-update step within progressDeadlineSeconds"
        )
    if newest is None:
        return
    posted = (newest.step, newest.result)
    if posted == writes.last_posted:
        return
    if newest.result == "Failed":
        message = f"step {newest.step}: {newest.message}"[:EVENT_MESSAGE_MAX_CHARS]
        post_event(api, body, "Warning", "StepFailed", message)
    elif now - writes.last_success_event >= SUCCESS_EVENT_INTERVAL and (budget is None or budget.take(now)):
        post_event(
            api,
            body,
            "Normal",
            "StepCompleted",
            f"step {newest.step} synced {newest.bytes} bytes in {newest.sync_seconds:.3f} s",
        )
        writes.last_success_event = now
    else:
        return
    writes.last_posted = posted
