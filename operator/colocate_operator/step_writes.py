"""A job's step-owned status (weightSync, recentSteps, rollout, the step conditions) and when to write it.

Writes are coalesced per job: a write waits WRITE_SETTLE_SECONDS for the rest of a burst and comes at most
every WRITE_MIN_INTERVAL_SECONDS, so a burst of steps costs one write; phase-only changes wait for a
heartbeat. What a write carries is snapshotted on the event loop (`StepSnapshot`), and the write itself, a
blocking patch with optimistic concurrency, runs in a thread (`write_status`), starting from the newest
view of the job it knows rather than a GET.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from colocate_operator import conditions, kube, metrics
from colocate_operator.conditions import Condition
from colocate_operator.indexes import version
from colocate_operator.status import RolloutStatus, StepRecordStatus, WeightSyncStatus, step_patch
from colocate_operator.steps import StepRecord, StepTracker, step_conditions

WRITE_SETTLE_SECONDS = 0.25  # after a step boundary, the rest of a burst joins the same write
WRITE_MIN_INTERVAL_SECONDS = 2.0  # status writes per job at most this often (a step per second: every 2nd)
HEARTBEAT_SECONDS = 15.0  # a phase-only change waits at most this long to reach status
WRITE_TRIES = 5


class JobGone(Exception):
    """The job was deleted while its follower ran."""


@dataclass(frozen=True)
class StepSnapshot:
    """What one status write carries, taken on the event loop (the reader goes on changing the tracker
    while the write runs in a thread)."""

    weight_sync: WeightSyncStatus
    recent_steps: tuple[StepRecordStatus, ...]
    conditions: tuple[Condition, ...]
    phase: str
    stalled: bool
    boundaries: int  # the follow's boundary count when taken
    newest: StepRecord | None
    rollout: RolloutStatus | None = None  # status.rollout (rollout_check.py)

    @classmethod
    def of(cls, tracker: StepTracker, stalled: bool, deadline: float, boundaries: int) -> StepSnapshot:
        return cls(
            tracker.weight_sync_status(),
            tracker.recent_steps_status(),
            tuple(step_conditions(tracker, stalled, deadline)),
            tracker.current_phase,
            stalled,
            boundaries,
            tracker.recent[-1] if tracker.recent else None,
            tracker.rollout.status(),
        )


@dataclass(frozen=True)
class JobView:
    """The job as the last status write left it (or as last read): enough to write again without a GET."""

    uid: str | None
    resource_version: str
    generation: int
    conditions: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, body: dict[str, Any]) -> JobView:
        meta = body["metadata"]
        return cls(
            meta.get("uid"),
            meta["resourceVersion"],
            int(meta.get("generation") or 0),
            tuple((body.get("status") or {}).get("conditions") or ()),
        )


def write_status(
    api: kube.Kube,
    namespace: str,
    name: str,
    snapshot: StepSnapshot,
    view: JobView | None = None,
    uid: str | None = None,
) -> JobView | None:
    """Patch the step-owned part of status with optimistic concurrency (the reconciler writes the rest),
    starting from `view` when given (no GET: the reconciler rarely writes a running job's status; a 409
    reads again). Returns the view the write left, None when every try lost a conflict; raises JobGone when
    the job no longer exists, or when `uid` is given and the job of that name is a newer one (deleted and
    created again: it gets its own follower)."""
    for _ in range(WRITE_TRIES):
        if view is None:
            body = api.get(kube.COLOCATE_JOBS, namespace, name)
            if body is None:
                raise JobGone(f"{namespace}/{name}")
            view = JobView.of(body)
        if uid is not None and view.uid != uid:
            raise JobGone(f"{namespace}/{name}")
        merged = conditions.merge(
            list(view.conditions), list(snapshot.conditions), datetime.now(UTC), view.generation
        )
        patch = {
            "metadata": {"resourceVersion": view.resource_version},
            "status": step_patch(snapshot.weight_sync, snapshot.recent_steps, merged, snapshot.rollout),
        }
        try:
            written = api.patch(kube.COLOCATE_JOBS, namespace, name, patch, subresource="status")
        except kube.KubeError as e:
            if e.status == 409:
                view = None  # the reconciler wrote in between: read again
                continue
            if e.status == 404:
                raise JobGone(f"{namespace}/{name}") from None
            raise
        metrics.STATUS_WRITES.labels("steps").inc()
        if not isinstance(written, str) or not written:
            return JobView(view.uid, "", view.generation, ())  # no resourceVersion echoed: read next time
        return JobView(view.uid, written, view.generation, tuple(merged))
    return None


def newer_view(mine: JobView | None, watched: JobView | None) -> JobView | None:
    """The newer of the view our last write left and the one the job's watch brought last (by
    resourceVersion; an opaque or empty one never counts as newer). None: read before writing."""
    if watched is None or mine is None:
        return mine
    newer = (version(watched.resource_version) or 0) > (version(mine.resource_version) or 0)
    return watched if newer else mine


@dataclass
class StatusWrites:
    """What a job's follower has written to status, and when: the coalescing and the retries go by it."""

    boundaries: int = 0  # step boundaries already in status (the follow counts those it saw)
    dirty_since: float = 0.0  # when the oldest boundary not yet in status was seen
    last_write: float = 0.0
    written_phase: str = ""
    written_stalled: bool = False
    last_success_event: float = 0.0
    last_posted: tuple[int, str] | None = None  # (step, result) of the last step Event
    retry_at: float = 0.0  # after a refused write, wait before the next try (and the next log line)
    view: JobView | None = None


def write_due(writes: StatusWrites) -> float:
    """When the step boundaries not yet in status may be written: after the burst settles, at most every
    WRITE_MIN_INTERVAL_SECONDS, and not before a retry is due."""
    return max(
        writes.retry_at,
        writes.dirty_since + WRITE_SETTLE_SECONDS,
        writes.last_write + WRITE_MIN_INTERVAL_SECONDS,
    )


# StepCompleted Events over all jobs: a token bucket. Up to 300 jobs stepping still get theirs once a
# minute; at 1000 jobs the 17 a second they would ask are a third of the step window's requests, competing
# with the status writes the user reads (docs/benchmarks.md). A success the budget defers goes out with
# the job's next write. Warnings (failed, stalled) are never held back.
SUCCESS_EVENTS_PER_SECOND = 5.0
SUCCESS_EVENTS_BURST = 50.0


@dataclass
class SuccessEventBudget:
    """The StepCompleted Events every follower of one operator may post: `burst` at once, refilled at
    `rate` a second. Taken from the followers' API threads, hence the lock."""

    rate: float = SUCCESS_EVENTS_PER_SECOND
    burst: float = SUCCESS_EVENTS_BURST
    tokens: float = -1.0  # full (`burst`) unless given
    at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, now: float) -> bool:
        with self._lock:
            if self.at is not None:
                self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
            self.at = now
            if self.tokens < 1.0:
                return False
            self.tokens -= 1.0
            return True
