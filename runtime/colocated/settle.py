"""How the writer settles a published step: its next move after what one wake-up of its wait observed.

The writer's wait (writer.py) gathers what it can see (the claimant's ACK, the abort key, the reader's
liveness, the store's reachability, its deadline) into an `Observed` and asks `next_move` what to do. The
answer is the rule the protocol serves, in one place: buckets are freed only after an ACK that says
`ipc_closed=true` (then only the buckets the reader never opened have their IPC share given back here), when
the reader is gone, or when the trainer took the step's claim back (no reader will map them); otherwise they
are parked. Pure: no I/O, no clock.

A wait has three phases: WAITING for the ACK; GIVING_UP after an abort or the step timeout (the abort is
written and the claim revoked, then the reader gets a grace period to close what it opened); and
AWAITING_DEATH after an ACK whose close failed (only the reader's death frees those buckets).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.outcome import (
    MetaStoreLost,
    PeerLost,
    StepAborted,
    StepFailed,
    StepRejected,
    StepTimedOut,
    WeightsMismatch,
)


class Phase(Enum):
    WAITING = "waiting"  # for the claimant's ACK
    GIVING_UP = "giving_up"  # aborted or timed out: the reader's grace period to close what it opened
    AWAITING_DEATH = "awaiting_death"  # the reader's close failed: its buckets wait for its death


class Act(Enum):
    WAIT = "wait"  # nothing decided: wake again
    FREE = "free"  # free the step's buckets now (giving back the IPC shares `Move.shares` says)
    PARK = "park"  # keep them, never reused, until their reader is done with them or gone
    GIVE_UP = "give_up"  # write the abort, take the claim back, then settle as GIVING_UP
    AWAIT_DEATH = "await_death"  # settle as AWAITING_DEATH


class Shares(Enum):
    """Whose torch CUDA IPC share the writer gives back itself when it frees (the reader closes the rest)."""

    ALL = "all"  # no reader maps any of them (none claimed, or it is gone)
    UNOPENED = "unopened"  # those the claimant's closed ACK does not list as opened (reaps with that ACK)


@dataclass(frozen=True, slots=True)
class Observed:
    """What one wake-up of the wait saw. Liveness is already judged by the phase's rule: WAITING counts a
    silent reader as lost only if it was ever seen or had claimed the step; later phases also count a
    claimant whose process on this host is gone."""

    phase: Phase = Phase.WAITING
    ack: Ack | None = None  # the claimant's ACK (one from anybody else is refused before it gets here)
    abort: str | None = None  # the step's abort reason
    keys_lost: bool = False  # Redis restarted and the step's manifest is gone
    unreachable: str | None = None  # the store could not be reached on this wake-up
    reader_lost: bool = False
    revoked: bool = False  # giving up, the trainer won the step's claim: no reader ever mapped it
    expired: bool = False  # the phase's deadline (the step timeout; giving up, the grace period)
    failing: type[StepFailed] | None = None  # after WAITING: the error the step already ends with


@dataclass(frozen=True, slots=True)
class Move:
    act: Act
    fails: type[StepFailed] | None = None  # the step's error once it settles (None: it completed)
    shares: Shares = Shares.ALL
    keep_standing: bool = False  # set aside the step's unopened kept exports for the next step (standing.py)


WAIT = Move(Act.WAIT)


def next_move(seen: Observed) -> Move:
    if seen.phase is Phase.WAITING:
        return _waiting(seen)
    if seen.phase is Phase.GIVING_UP:
        return _giving_up(seen)
    return _awaiting_death(seen)


def _waiting(seen: Observed) -> Move:
    if seen.ack is not None:
        return _acked(seen.ack)
    if seen.abort is not None:
        return Move(Act.GIVE_UP, StepAborted)
    if seen.keys_lost:
        return Move(Act.PARK, MetaStoreLost)  # nobody can finish the step: parked until a later ACK
    if seen.unreachable is None and seen.reader_lost:
        return Move(Act.FREE, PeerLost)
    if seen.expired:
        return (
            Move(Act.PARK, MetaStoreLost) if seen.unreachable is not None else Move(Act.GIVE_UP, StepTimedOut)
        )
    return WAIT


def _acked(ack: Ack) -> Move:
    if not ack.ipc_closed:
        # The reader could not verify its close: only its death (or its word, in a later ACK, that the
        # mappings are gone) makes the memory safe to reuse.
        return Move(Act.AWAIT_DEATH, StepRejected)
    clean = ack.status == "ok" and not ack.checksum_mismatches
    fails: type[StepFailed] | None = None
    if ack.digest_mismatches:
        fails = WeightsMismatch
    elif not clean:
        fails = StepAborted if ack.result == StepAborted.result else StepRejected
    return Move(Act.FREE, fails, Shares.UNOPENED, keep_standing=clean)


def _giving_up(seen: Observed) -> Move:
    if seen.revoked:
        return Move(Act.FREE, seen.failing)
    if seen.ack is not None and seen.ack.ipc_closed:
        return Move(Act.FREE, seen.failing, Shares.UNOPENED)
    if seen.reader_lost:
        return Move(Act.FREE, seen.failing)
    if seen.expired:
        return Move(Act.PARK, seen.failing)
    return WAIT


def _awaiting_death(seen: Observed) -> Move:
    if seen.reader_lost:
        return Move(Act.FREE, seen.failing)
    if seen.expired:
        return Move(Act.PARK, seen.failing)
    return WAIT


def wait_failure(
    seen: Observed, fails: type[StepFailed], *, step: int, gpu: str, timeout_s: float, store: str
) -> StepFailed:
    """The error of a step that WAITING settled without an ACK (`fails`, from `next_move`)."""
    if fails is StepAborted:
        return StepAborted(f"step {step} aborted: {seen.abort}", step=step)
    if fails is StepTimedOut:
        return StepTimedOut(f"step {step}: no ACK from the reader on {gpu} within {timeout_s}s", step=step)
    if fails is PeerLost:
        return PeerLost(
            f"reader on {gpu} stopped heartbeating during step {step}; buckets freed", step=step, freed=True
        )
    if seen.keys_lost:
        return MetaStoreLost(
            f"meta-store {store} restarted during step {step} and lost its keys; buckets parked until the "
            "reader acknowledges a later step",
            step=step,
            freed=False,
        )
    return MetaStoreLost(
        f"step {step}: {seen.unreachable} for the whole step timeout; buckets parked", step=step, freed=False
    )


def ack_failure(ack: Ack, fails: type[StepFailed], *, step: int, freed: bool) -> StepFailed:
    """The error of a step whose claimant's ACK failed it (`fails`, from `next_move`)."""
    if not ack.ipc_closed:
        return StepRejected(
            f"step {step}: reader failed without closing its mappings ({ack.error}); "
            f"buckets {'freed after its death' if freed else 'parked'}",
            step=step,
            freed=freed,
        )
    if fails is WeightsMismatch:
        return WeightsMismatch(
            f"step {step} failed in the reader: {ack.error}",
            parameters=ack.digest_mismatches,
            step=step,
            freed=freed,
        )
    detail = ack.error or f"checksum mismatch in {list(ack.checksum_mismatches)}"
    return fails(f"step {step} failed in the reader: {detail}", step=step, freed=freed)
