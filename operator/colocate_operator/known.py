"""What earlier passes learnt about a job that cannot silently change, so event-driven passes skip reading it.

Two facts qualify: a child (Service, Secret, ...) that exists and is owned by the job, and a ResourceClaim's
allocation (fixed for the claim's life; a new pod gets a new claim name). Children are read again once their
entry is older than `max_age` (the resync interval), so a child someone deleted is re-created by the next
resync, as before; everything that does change (the job, its pods, the meta-store's readiness) is read
fresh on every pass. Keyed by the job's uid: a job re-created under the same name starts from nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from colocate_operator.observed import ClaimState


@dataclass
class _Job:
    children: dict[str, float] = field(default_factory=dict)  # Kind/name -> when seen
    conflicts: set[str] = field(default_factory=set)  # Kind/name whose create was refused with 409
    claims: dict[str, ClaimState] = field(default_factory=dict)  # allocated claims only


class KnownFacts:
    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def children(self, uid: str) -> frozenset[str]:
        """Children seen within `max_age`: the pass need not read them."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(uid)
            if job is None:
                return frozenset()
            return frozenset(c for c, seen in job.children.items() if now - seen < self.max_age)

    def saw_children(self, uid: str, children: Iterable[str]) -> None:
        now = self._clock()
        with self._lock:
            job = self._jobs.setdefault(uid, _Job())
            job.children.update(dict.fromkeys(children, now))

    def lost_child(self, uid: str, child: str) -> None:
        with self._lock:
            if uid in self._jobs:
                self._jobs[uid].children.pop(child, None)

    def conflict(self, uid: str, child: str) -> None:
        """A create of `child` found the name taken: the next passes read it until it is ours or gone."""
        with self._lock:
            job = self._jobs.setdefault(uid, _Job())
            job.children.pop(child, None)
            job.conflicts.add(child)

    def conflicts(self, uid: str) -> frozenset[str]:
        with self._lock:
            job = self._jobs.get(uid)
            return frozenset(job.conflicts) if job else frozenset()

    def resolved(self, uid: str, child: str) -> None:
        with self._lock:
            if uid in self._jobs:
                self._jobs[uid].conflicts.discard(child)

    def claims(self, uid: str) -> dict[str, ClaimState]:
        with self._lock:
            job = self._jobs.get(uid)
            return dict(job.claims) if job else {}

    def saw_claims(self, uid: str, claims: dict[str, ClaimState]) -> None:
        """Keep the allocated ones among `claims`, the claims the job's pods name now (older ones dropped)."""
        with self._lock:
            job = self._jobs.setdefault(uid, _Job())
            job.claims = {name: c for name, c in claims.items() if c.allocated}

    def forget(self, uid: str) -> None:
        with self._lock:
            self._jobs.pop(uid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
