"""A deduplicating work queue of job keys, with delayed adds: client-go's workqueue semantics, in threads.

Watch handlers only add a key and return, so a burst of pod events never occupies kopf's workers while
passes wait on the API server. A key is queued at most once however often it is added, is never handed to
two workers at once, and a key added while a worker holds it is handed out again once that worker is done,
so the newest state is always reconciled. Delayed adds (requeue after N seconds) live in one heap served
by the workers themselves: no timer thread per job.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: deque[K] = deque()
        self._queued: set[K] = set()  # in _ready, or to be re-queued when its worker is done
        self._processing: set[K] = set()
        self._due: dict[K, float] = {}  # earliest pending delayed add per key
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._closed = False

    def add(self, key: K) -> None:
        with self._cond:
            if self._closed or key in self._queued:
                return
            self._queued.add(key)
            if key not in self._processing:  # otherwise `done` queues it
                self._ready.append(key)
                self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        due = self._clock() + delay
        with self._cond:
            if self._closed or self._due.get(key, float("inf")) <= due:
                return  # an earlier requeue is pending already
            self._due[key] = due
            heapq.heappush(self._heap, (due, next(self._seq), key))
            self._cond.notify()

    def get(self, timeout: float | None = None) -> K | None:
        """The next key to process, or None once closed (or after `timeout` seconds with nothing due)."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote_due()
                if self._closed:
                    return None
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                wait = self._heap[0][0] - self._clock() if self._heap else None
                if end is not None:
                    left = end - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: K) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._queued:
                self._ready.append(key)
                self._cond.notify()

    def forget(self, key: K) -> None:
        """Drop a pending delayed add (the job is gone); a queued or running pass is left alone."""
        with self._cond:
            self._due.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _promote_due(self) -> None:
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            due, _, key = heapq.heappop(self._heap)
            if self._due.get(key) != due:
                continue  # superseded by an earlier add_after, or forgotten
            del self._due[key]
            if key not in self._queued:
                self._queued.add(key)
                if key not in self._processing:
                    self._ready.append(key)
