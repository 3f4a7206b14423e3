"""Every trainer rank ends a phase of a step the same way: each states its outcome, all see all of them.

A step is collective (one engine per pod, several trainer ranks per engine, several pods): one rank's
failure must fail the step on every rank with the same message naming that rank, or the ranks drift apart
(some train on, some wait for a step that never completes). The outcomes travel over a gloo group of the
publisher's own, with a bounded timeout, so a failure here can never poison the trainer's NCCL groups.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A phase of a step failed on one or more ranks; raised on every rank with the same message."""

    def __init__(self, message: str, *, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed  # global rank -> "Type: message"


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class Agreement:
    """All-gathers each rank's outcome of a phase (None = ok) over a gloo group of its own."""

    def __init__(self, timeout_s: float) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # One rank alone agrees with itself: no group, no collective on its step path.
        self.group = (
            None
            if self.world == 1
            else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        )

    def outcomes(self, error: BaseException | str | None) -> dict[int, str]:
        """Collective: the failed ranks (global rank -> message) as every rank sees them."""
        mine = None if error is None else (error if isinstance(error, str) else describe(error))
        gathered: list[str | None] = [mine]
        if self.group is not None:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, mine, group=self.group)
        return {rank: msg for rank, msg in enumerate(gathered) if msg is not None}

    def check(self, what: str, error: BaseException | str | None) -> None:
        """Collective: raise RankFailed on every rank if `what` failed on any."""
        failed = self.outcomes(error)
        if failed:
            first = min(failed)
            others = f" (and on rank(s) {sorted(set(failed) - {first})})" if len(failed) > 1 else ""
            raise RankFailed(f"{what} failed on rank {first}: {failed[first]}{others}", failed=failed)

    def gather(self, value: object) -> list[object]:
        if self.group is None:
            return [value]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out
