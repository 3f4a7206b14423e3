"""The last read of each Secret a job's meta-store password comes from, shared by the reconciler and the step
followers, so that a job's start costs one read of its External meta-store Secret instead of two.

Kept only `max_age` seconds (the resync interval: as long as the reconciler trusts a child it saw). A reader
that needs the newest value (a follower reconnecting after a failure: the password may have been rotated)
reads the Secret again, which also refreshes the entry. Values are never logged (no repr).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from colocate_operator import kube


@dataclass(frozen=True)
class SecretRead:
    resource_version: str | None
    data: dict[str, str] = field(repr=False)  # the Secret's base64 values, as the API server sent them
    at: float = 0.0


SHARED_WAIT_SECONDS = 35.0  # longer than one request may take (kube.TIMEOUT)


@dataclass(eq=False)
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    result: SecretRead | None = field(default=None, repr=False)
    ok: bool = False


class SecretReads:
    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self._clock = clock
        self._reads: dict[tuple[str, str], SecretRead] = {}
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SecretReads({len(self._reads)} secrets)"

    def recent(self, namespace: str, name: str) -> SecretRead | None:
        """The last read of the Secret if within `max_age`, else None (read it)."""
        with self._lock:
            seen = self._reads.get((namespace, name))
            if seen is None or self._clock() - seen.at > self.max_age:
                return None
            return seen

    def read_shared(self, api: kube.Kube, namespace: str, name: str) -> SecretRead | None:
        """`read`, except that a caller finding a read of the same Secret in flight waits for that one's
        answer: the passes of many jobs sharing one Secret start together (an operator's start, a burst of
        new jobs) and would each read it. Not for a reader that needs a value newer than its own last try."""
        key = (namespace, name)
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            if flight.done.wait(SHARED_WAIT_SECONDS) and flight.ok:
                return flight.result
            return self.read(api, namespace, name)  # the leader failed (or hangs): try on our own
        try:
            flight.result = self.read(api, namespace, name)
            flight.ok = True
            return flight.result
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.done.set()

    def read(self, api: kube.Kube, namespace: str, name: str) -> SecretRead | None:
        """Read the Secret from the API server and remember it; None when it does not exist."""
        body = api.get(kube.SECRETS, namespace, name)
        with self._lock:
            if body is None:
                self._reads.pop((namespace, name), None)
                return None
            seen = SecretRead(
                (body.get("metadata") or {}).get("resourceVersion"),
                dict(body.get("data") or {}),
                self._clock(),
            )
            self._reads[(namespace, name)] = seen
            return seen
