"""The order in which ranks meet their peers: a round-robin tournament (the circle method).

In each round every rank faces at most one partner and both directions between the two run in one batch, so a
rank only ever waits for the rank that is waiting for it, in the same round. All ranks walk the rounds in the
same order, so no cycle of waits can form. Unlike a recursive-halving schedule it is correct for every world
size: odd worlds add a phantom rank, and whoever draws it sits the round out.
"""

from __future__ import annotations


def num_rounds(world: int) -> int:
    """Rounds in which every pair of distinct ranks meets exactly once."""
    if world < 1:
        raise ValueError(f"world size must be positive, got {world}")
    if world == 1:
        return 0
    return world - 1 if world % 2 == 0 else world


def _slots(world: int) -> int:
    return world if world % 2 == 0 else world + 1


def partner(rank: int, round_: int, world: int) -> int | None:
    """Who `rank` faces in `round_`, or None when it sits out (it drew the phantom of an odd world)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    n = _slots(world)
    if not 0 <= round_ < n - 1:
        raise ValueError(f"round {round_} is outside 0..{n - 2}")
    fixed, ring = n - 1, n - 1
    if rank == fixed:
        # The fixed rank meets the ring rank i with 2i = round (mod ring); ring is odd so 2 is invertible.
        other = (round_ * (ring + 1) // 2) % ring
    else:
        other = (round_ - rank) % ring
        if other == rank:
            other = fixed
    return None if other >= world else other


def meeting_round(a: int, b: int, world: int) -> int:
    """The round in which distinct ranks `a` and `b` face each other."""
    if a == b or not (0 <= a < world and 0 <= b < world):
        raise ValueError(f"no meeting between {a} and {b} in a world of {world}")
    n = _slots(world)
    ring = n - 1
    if a == ring:
        return (2 * b) % ring
    if b == ring:
        return (2 * a) % ring
    return (a + b) % ring
