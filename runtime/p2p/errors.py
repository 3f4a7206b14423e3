"""Errors the executor raises: each says which rank or peer to look at."""

from __future__ import annotations


class P2PError(RuntimeError):
    """A cross-GPU exchange failed; the message names the rank, peer or parameter involved."""


class PlanMismatchError(P2PError):
    """Ranks computed different plans (different metadata or code): nothing was sent."""


class PeerTimeoutError(P2PError):
    """A peer batch did not drain in time: the peer is dead, stuck or running a different schedule."""

    def __init__(self, message: str, *, peer: int, chunk: int, round_: int) -> None:
        super().__init__(message)
        self.peer = peer
        self.chunk = chunk
        self.round = round_
