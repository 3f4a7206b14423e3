"""Where a step's time goes: runtime calls wrapped with timers in both processes of a bench, on one clock.

`time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so spans
recorded by the trainer and by the reader fall on one timeline. A span belongs to the step during which it
ended (a reader's wait starts before the step it returns). The wrappers cost a few microseconds a call, so a
traced step runs a little slower than an untraced one: use it to see where the time goes, not for the figure.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

Span = tuple[str, float, float]  # label, start, end (perf_counter seconds)


class CallTrace:
    def __init__(self) -> None:
        self.spans: list[Span] = []

    def wrap(self, owner: Any, attr: str, label: str | None = None) -> None:
        """Replace `owner.attr` (a method of an instance, or a module's function) with a timed call."""
        inner: Callable[..., Any] = getattr(owner, attr)
        name = label or attr
        spans = self.spans

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spans.append((name, t0, time.perf_counter()))

        setattr(owner, attr, timed)


def timeline(step_starts: list[float], spans: list[Span], *, skip: int = 1) -> str:
    """A table of each label's median first start and last end (ms from the step's start), calls and time
    spent in them per step, over the steps after the first `skip` (warm-up)."""
    bounds = [*step_starts, float("inf")]
    rows: dict[str, list[tuple[float, float, int, float]]] = {}
    for k in range(skip, len(step_starts)):
        lo, hi = bounds[k], bounds[k + 1]
        mine: dict[str, list[Span]] = {}
        for span in spans:
            if lo <= span[2] < hi:
                mine.setdefault(span[0], []).append(span)
        for label, got in mine.items():
            first = min(s[1] for s in got) - lo
            last = max(s[2] for s in got) - lo
            rows.setdefault(label, []).append((first, last, len(got), sum(s[2] - s[1] for s in got)))
    steps = len(step_starts) - skip
    head = f"{'call':<28} {'from ms':>8} {'to ms':>8} {'calls':>6} {'in calls ms':>12}"
    lines = [f"{head}  (median of {steps} steps)"]
    order = sorted(rows, key=lambda label: statistics.median(r[1] for r in rows[label]))
    for label in order:
        got = rows[label]
        lines.append(
            f"{label:<28} {statistics.median(r[0] for r in got) * 1e3:>8.3f} "
            f"{statistics.median(r[1] for r in got) * 1e3:>8.3f} {statistics.median(r[2] for r in got):>6g} "
            f"{statistics.median(r[3] for r in got) * 1e3:>12.3f}"
        )
    return "\n".join(lines)
