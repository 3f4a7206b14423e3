"""A bounded history of applied updates, with guards for the short cases.

AWEX crashed comparing the last two entries of a one-entry history. Every question asked here answers `None`
while the history is too short to answer it: fewer than two entries for a comparison, zero for an average.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    gen: int
    step: int
    layout_hash: str
    bytes: int
    seconds: float


class UpdateHistory:
    def __init__(self, limit: int = 16) -> None:
        if limit < 1:
            raise ValueError("history limit must be at least 1")
        self._records: deque[UpdateRecord] = deque(maxlen=limit)

    def record(self, rec: UpdateRecord) -> None:
        self._records.append(rec)

    def __len__(self) -> int:
        return len(self._records)

    def last(self) -> UpdateRecord | None:
        return self._records[-1] if self._records else None

    def layout_changed(self) -> bool | None:
        """Did the last update's layout differ from the one before? None with fewer than two updates."""
        if len(self._records) < 2:
            return None
        return self._records[-1].layout_hash != self._records[-2].layout_hash

    def mean_seconds(self) -> float | None:
        if not self._records:
            return None
        return sum(r.seconds for r in self._records) / len(self._records)

    def mean_bandwidth(self) -> float | None:
        """Bytes per second over the history; None with zero updates or zero time."""
        total_s = sum(r.seconds for r in self._records)
        if not self._records or total_s <= 0:
            return None
        return sum(r.bytes for r in self._records) / total_s
