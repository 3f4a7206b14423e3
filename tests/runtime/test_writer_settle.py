"""The writer's next move (settle.next_move) as a table: what one wake-up of its wait observed -> the move."""

from __future__ import annotations

import pytest

from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.outcome import (
    MetaStoreLost,
    PeerLost,
    StepAborted,
    StepRejected,
    StepTimedOut,
    WeightsMismatch,
)
from colocate_runtime.colocated.settle import (
    Act,
    Move,
    Observed,
    Phase,
    Shares,
    ack_failure,
    next_move,
    wait_failure,
)

OK = Ack(status="ok", ipc_closed=True)
NOT_CLOSED = Ack(status="error", ipc_closed=False, error="close failed")
REJECTED = Ack(status="error", ipc_closed=True, error="CoverageError: x")
ABORTED = Ack(status="error", ipc_closed=True, result="aborted", error="StepAborted: y")
CHECKSUMS = Ack(status="ok", ipc_closed=True, checksum_mismatches=("w",))
DIGEST = Ack(status="error", ipc_closed=True, digest_mismatches=("w",), error="weights check failed")
DIGEST_OK_STATUS = Ack(status="ok", ipc_closed=True, digest_mismatches=("w",))

WAIT = Move(Act.WAIT)
GIVING_UP = Phase.GIVING_UP
DEATH = Phase.AWAITING_DEATH

TABLE = [
    # --- waiting for the ACK --------------------------------------------------------------------------
    ("nothing yet", Observed(), WAIT),
    ("clean ACK", Observed(ack=OK), Move(Act.FREE, None, Shares.UNOPENED, keep_standing=True)),
    ("ACK, close failed", Observed(ack=NOT_CLOSED), Move(Act.AWAIT_DEATH, StepRejected)),
    ("reader error", Observed(ack=REJECTED), Move(Act.FREE, StepRejected, Shares.UNOPENED)),
    ("reader aborted", Observed(ack=ABORTED), Move(Act.FREE, StepAborted, Shares.UNOPENED)),
    ("checksums differ", Observed(ack=CHECKSUMS), Move(Act.FREE, StepRejected, Shares.UNOPENED)),
    ("digest differs", Observed(ack=DIGEST), Move(Act.FREE, WeightsMismatch, Shares.UNOPENED)),
    (
        "digest differs, status ok",
        Observed(ack=DIGEST_OK_STATUS),
        Move(Act.FREE, WeightsMismatch, Shares.UNOPENED, keep_standing=True),
    ),
    (
        "ACK wins over expiry",
        Observed(ack=OK, expired=True, reader_lost=True),
        Move(Act.FREE, None, Shares.UNOPENED, keep_standing=True),
    ),
    ("aborted", Observed(abort="operator"), Move(Act.GIVE_UP, StepAborted)),
    ("abort wins over expiry", Observed(abort="x", expired=True), Move(Act.GIVE_UP, StepAborted)),
    ("keys lost in a restart", Observed(keys_lost=True), Move(Act.PARK, MetaStoreLost)),
    ("reader lost", Observed(reader_lost=True), Move(Act.FREE, PeerLost)),
    ("reader lost wins over expiry", Observed(reader_lost=True, expired=True), Move(Act.FREE, PeerLost)),
    ("unreachable: liveness unknown", Observed(unreachable="down", reader_lost=True), WAIT),
    ("unreachable to the end", Observed(unreachable="down", expired=True), Move(Act.PARK, MetaStoreLost)),
    ("timed out", Observed(expired=True), Move(Act.GIVE_UP, StepTimedOut)),
    # --- giving up (aborted or timed out) ---------------------------------------------------------------
    (
        "claim taken back",
        Observed(GIVING_UP, revoked=True, failing=StepTimedOut),
        Move(Act.FREE, StepTimedOut),
    ),
    ("grace: nothing yet", Observed(GIVING_UP, failing=StepTimedOut), WAIT),
    (
        "grace: closed ACK",
        Observed(GIVING_UP, ack=REJECTED, failing=StepAborted),
        Move(Act.FREE, StepAborted, Shares.UNOPENED),
    ),
    ("grace: ACK, close failed", Observed(GIVING_UP, ack=NOT_CLOSED, failing=StepAborted), WAIT),
    (
        "grace: ACK, close failed, reader gone",
        Observed(GIVING_UP, ack=NOT_CLOSED, reader_lost=True, failing=StepAborted),
        Move(Act.FREE, StepAborted),
    ),
    (
        "grace: reader gone",
        Observed(GIVING_UP, reader_lost=True, failing=StepTimedOut),
        Move(Act.FREE, StepTimedOut),
    ),
    ("grace over", Observed(GIVING_UP, expired=True, failing=StepTimedOut), Move(Act.PARK, StepTimedOut)),
    (
        "grace over, ACK close failed",
        Observed(GIVING_UP, ack=NOT_CLOSED, expired=True, failing=StepTimedOut),
        Move(Act.PARK, StepTimedOut),
    ),
    # --- awaiting the death of a reader whose close failed ---------------------------------------------
    ("alive", Observed(DEATH, failing=StepRejected), WAIT),
    ("dead", Observed(DEATH, reader_lost=True, failing=StepRejected), Move(Act.FREE, StepRejected)),
    ("step deadline", Observed(DEATH, expired=True, failing=StepRejected), Move(Act.PARK, StepRejected)),
]


@pytest.mark.parametrize(("seen", "move"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_next_move(seen: Observed, move: Move) -> None:
    assert next_move(seen) == move


def test_only_freeing_on_a_closed_ack_gives_back_just_the_unopened_shares() -> None:
    for _, seen, move in TABLE:
        closed_ack = seen.ack is not None and seen.ack.ipc_closed and not seen.revoked
        if move.shares is Shares.UNOPENED:
            assert move.act is Act.FREE and closed_ack
        if move.act is Act.FREE and not closed_ack:
            assert move.shares is Shares.ALL


@pytest.mark.parametrize(
    ("seen", "fails", "kind", "freed", "text"),
    [
        (Observed(abort="operator"), StepAborted, StepAborted, None, "step 3 aborted: operator"),
        (
            Observed(expired=True),
            StepTimedOut,
            StepTimedOut,
            None,
            "no ACK from the reader on GPU-1 within 9.0s",
        ),
        (Observed(reader_lost=True), PeerLost, PeerLost, True, "stopped heartbeating during step 3"),
        (Observed(keys_lost=True), MetaStoreLost, MetaStoreLost, False, "redis:1 restarted during step 3"),
        (
            Observed(unreachable="down", expired=True),
            MetaStoreLost,
            MetaStoreLost,
            False,
            "down for the whole",
        ),
    ],
)
def test_wait_failure(seen: Observed, fails: type, kind: type, freed: bool | None, text: str) -> None:
    err = wait_failure(seen, fails, step=3, gpu="GPU-1", timeout_s=9.0, store="redis:1")
    assert type(err) is kind and err.step == 3 and err.freed is freed and text in str(err)


@pytest.mark.parametrize(
    ("ack", "fails", "freed", "kind", "text"),
    [
        (
            NOT_CLOSED,
            StepRejected,
            True,
            StepRejected,
            "without closing its mappings (close failed); buckets freed",
        ),
        (NOT_CLOSED, StepRejected, False, StepRejected, "buckets parked"),
        (DIGEST, WeightsMismatch, True, WeightsMismatch, "failed in the reader: weights check failed"),
        (ABORTED, StepAborted, True, StepAborted, "failed in the reader: StepAborted: y"),
        (CHECKSUMS, StepRejected, True, StepRejected, "checksum mismatch in ['w']"),
    ],
)
def test_ack_failure(ack: Ack, fails: type, freed: bool, kind: type, text: str) -> None:
    err = ack_failure(ack, fails, step=3, freed=freed)
    assert type(err) is kind and err.freed is freed and text in str(err)
    if kind is WeightsMismatch:
        assert err.parameters == ("w",)
