"""Deadlines for bounded waits: every wait in the runtime has one and wakes at least once a second."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WAKE_S = 1.0


@dataclass(slots=True)
class Deadline:
    seconds: float
    start: float = field(default_factory=time.monotonic)

    @property
    def at(self) -> float:
        return self.start + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def slice(self, wake_s: float = WAKE_S) -> float:
        """How long the next blocking call may block: until the next wake-up or the deadline."""
        return max(0.0, min(wake_s, self.remaining()))
