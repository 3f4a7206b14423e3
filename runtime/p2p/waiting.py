"""Waiting on torch.distributed work with a deadline, so a stuck peer becomes an error instead of a hang.

NCCL work is polled: its wait() only makes the current stream wait and returns at once, so the host checks
completion itself against the clock. CPU transports (gloo) block in a wait() that is given the remaining time.
On a timeout the process group is aborted (NCCL) so no kernel outlives the error, and the error names the
peer the rank was waiting for.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from colocate_runtime.p2p.errors import P2PError, PeerTimeoutError

log = logging.getLogger("colocate_runtime.p2p")

# Yield for a while first (sleep granularity on VMs can exceed a chunk's time on the wire), then sleep.
_POLL_SPINS = 20_000
_POLL_SLEEP_S = 1e-3
# gloo truncates a wait's timeout to whole milliseconds, so its timeout can fire just before our deadline.
_CLOCK_SLACK_S = 0.01
GONE = "a rank is dead, stuck or on a different schedule; the process group is no longer usable"


class Deadlines:
    """The waits of one rank in one process group, each bounded by `timeout_s`."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.timeout_s = timeout_s
        self.polls = dist.get_backend(group) == "nccl"

    def wait(self, works: list) -> bool:
        """Whether `works` completed within the timeout; transport errors propagate as RuntimeError."""
        deadline = time.monotonic() + self.timeout_s
        if self.polls:
            spins = 0
            while not all(w.is_completed() for w in works):
                if time.monotonic() > deadline:
                    return False
                spins += 1
                time.sleep(0 if spins < _POLL_SPINS else _POLL_SLEEP_S)
            for w in works:
                w.wait()
            return True
        for w in works:
            try:
                w.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError:
                if time.monotonic() >= deadline - _CLOCK_SLACK_S:
                    return False
                raise
        return True

    def wait_for_peer(self, works: list, peer: int, where: str, *, chunk: int, round_: int) -> None:
        """Wait for a batch with `peer`: a timeout or a transport error is raised naming the peer."""
        try:
            done = self.wait(works)
        except RuntimeError as exc:
            raise P2PError(f"rank {self.rank}: exchange with peer {peer} failed ({where}): {exc}") from exc
        if not done:
            waited = f"{self.timeout_s:g} s"
            message = f"rank {self.rank}: no progress for {waited} waiting on peer {peer} ({where}): {GONE}"
            self.fail(message)
            raise PeerTimeoutError(message, peer=peer, chunk=chunk, round_=round_)

    def wait_for_group(self, works: list, what: str) -> None:
        """Wait for a collective; on a timeout nobody in particular can be named."""
        if not self.wait(works):
            message = f"rank {self.rank}: {what} did not complete within {self.timeout_s:g} s: {GONE}"
            self.fail(message)
            raise P2PError(message)

    def fail(self, message: str) -> None:
        log.error(message)
        try:
            self.abort()
        except Exception:  # best effort: the timeout is the error worth reporting
            log.exception("rank %d: aborting the process group failed", self.rank)

    def abort(self) -> None:
        """Tear the NCCL communicator down so stuck kernels cannot outlive the error."""
        if self.polls:
            dist.distributed_c10d._abort_process_group(self.group)
