"""One job's step stream as its follower holds it: where reading got to, the tracker the entries fold into,
and what was skipped on the way (entries that are not step events, entries too large to read).

The stream is untrusted input (any container of the job writes it): whatever one entry raises, it is skipped
and counted, never fatal, and the count reaches the job as an Event (step_events.py). The reader
(stream_reads.py) feeds the entries in; the job's own task (step_follow.py) writes status from the tracker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from colocate_operator import metrics
from colocate_operator.observed import StreamProgress
from colocate_operator.step_writes import JobView
from colocate_operator.steps import StepTracker
from colocate_runtime.contract.events import (
    ENTRY_MAX_FIELDS,
    FIELD_MAX_BYTES,
    STREAM_MAXLEN,
    EventError,
    decode,
    decode_joined,
)

log = logging.getLogger("colocate_operator.steps")

SKIP_EVENT_INTERVAL = 60.0  # skipped entries reach the job as one Event per job at most this often
TRIM_EVERY = 1000  # entries read between two XTRIMs of a stream
# The largest entry the decoder can accept (ENTRY_MAX_FIELDS keys and values of FIELD_MAX_BYTES each): a
# larger one is skipped in the meta-store, never sent to the operator (any container can XADD hundreds of MB).
ENTRY_MAX_BYTES = 2 * ENTRY_MAX_FIELDS * FIELD_MAX_BYTES


@dataclass
class Skips:
    """Entries skipped and GPUs/steps dropped, reported as one Event at most every SKIP_EVENT_INTERVAL."""

    count: int = 0
    last: str = ""
    reported_count: int = 0
    reported_dropped: int = 0
    last_event: float = float("-inf")
    oversized: int = 0  # entries over ENTRY_MAX_BYTES, left unread in the store
    largest: int = 0  # bytes of the largest of them since the last Event
    reported_oversized: int = 0

    def pending(self, dropped: int) -> bool:
        """Something not yet reported: skipped entries, or (`dropped`, the tracker's) GPUs/steps let go of."""
        return (
            self.count != self.reported_count
            or self.oversized != self.reported_oversized
            or dropped != self.reported_dropped
        )


@dataclass
class Trim:
    """XTRIM MAXLEN ~ STREAM_MAXLEN every TRIM_EVERY entries read: the writers cap the stream themselves,
    but a writer that does not must not grow Redis or the next replay. A store that refuses XTRIM (an
    External one with a restricted user) is followed untrimmed."""

    unread: int = 0
    refused: bool = False

    async def maybe(self, client: aioredis.Redis, key: str, job: str) -> None:
        if self.refused or self.unread < TRIM_EVERY:
            return
        self.unread = 0
        try:
            # LIMIT 0: an approximate trim otherwise removes at most 10000 entries per call.
            await client.xtrim(key, maxlen=STREAM_MAXLEN, approximate=True, limit=0)
        except ResponseError as e:
            self.refused = True
            log.warning("the meta-store of %s refuses XTRIM, not trimming: %s", job, e)


@dataclass(eq=False)
class JobStream:
    """One job's stream state, shared by its reader (which feeds it entries) and its own task (which writes
    status). Both run on the event loop, so no lock."""

    namespace: str
    name: str
    uid: str | None
    key: str
    tracker: StepTracker
    progress: StreamProgress
    last_id: str = "0-0"
    boundaries: int = 0  # step boundaries seen
    reads: int = 0  # XREADs that covered this stream
    wakes: int = 0  # times its writer woke (news or a decision due): tests count them
    skips: Skips = field(default_factory=Skips)
    trim: Trim = field(default_factory=Trim)
    news: asyncio.Event = field(default_factory=asyncio.Event)  # the reader brought entries, or left
    lost: asyncio.Future[None] | None = None  # done when the reader lets go of the job (with its error)
    # The job as its newest watch event showed it (StepWatchers keeps it): a write starts from it when it is
    # newer than what the last write left, instead of losing a 409 to the reconciler's writes and reading.
    latest_view: Callable[[], JobView | None] | None = None

    @property
    def job(self) -> str:
        return f"{self.namespace}/{self.name}"

    def consume(self, entries: list[Any]) -> bool:
        """Fold entries (`[entry_id, [key, value, ...]]` each, as a raw XREAD reply holds them, or
        `[entry_id, keys and values joined by NUL]` as the bounded read sends most) into the tracker; True
        when its writer has news (a step boundary, a new phase, something to report), so that entries
        changing nothing it writes wake no task. The stream is untrusted input: whatever one entry raises, it
        is skipped and counted, never fatal."""
        self.trim.unread += len(entries)
        tracker = self.tracker
        mark = (self.boundaries, tracker.current_phase, self.skips.count, tracker.dropped)
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                event = decode_joined(fields) if type(fields) is bytes else decode(fields)
                before = (tracker.last_completed_step, len(tracker.recent))
                if tracker.observe(event):
                    self.boundaries += 1
                    _record_metrics(self.namespace, self.name, tracker, before)
            except Exception as e:  # one entry never stops the follower, whatever it holds
                self.skips.count += 1
                self.skips.last = str(e) if isinstance(e, EventError) else type(e).__name__
        return mark != (self.boundaries, tracker.current_phase, self.skips.count, tracker.dropped)

    def skip_oversized(self, skipped: list[Any], last: bytes | str) -> bool:
        """Count entries the bounded read left in the store (`[entry_id, bytes]` each) and move past them
        and everything else looked at up to `last`, so that no replay reads them again. True: there were."""
        self.last_id = last.decode() if isinstance(last, bytes) else str(last)
        for _, size in skipped:
            self.skips.oversized += 1
            self.skips.largest = max(self.skips.largest, int(size))
        return bool(skipped)

    def let_go(self, error: BaseException | None) -> None:
        if self.lost is not None and not self.lost.done():
            if error is None:
                self.lost.set_result(None)
            else:
                self.lost.set_exception(error)
        self.news.set()


def _record_metrics(namespace: str, name: str, tracker: StepTracker, before: tuple[int | None, int]) -> None:
    if tracker.last_completed_step != before[0] and tracker.last_completed_step is not None:
        metrics.LAST_COMPLETED_STEP.labels(namespace, name).set(tracker.last_completed_step)
        metrics.SYNC_SECONDS.labels(namespace, name).observe(tracker.last_sync_seconds)
    elif tracker.last_failure is not None and len(tracker.recent) != before[1]:
        metrics.FAILED_STEPS.labels(namespace, name).inc()
