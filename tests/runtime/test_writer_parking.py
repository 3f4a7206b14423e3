"""The writer's bookkeeping of owned buckets on its own: which shares a free gives back (pending.py), when a
later ACK supersedes a parked step (parking.superseded) and which exports stand to the next step
(standing.py). No Redis: a recording exporter stands in for CUDA IPC."""

from __future__ import annotations

import pytest
import torch

from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import reader_identity, step_claim
from colocate_runtime.colocated.parking import superseded
from colocate_runtime.colocated.pending import PendingStep, free
from colocate_runtime.colocated.settle import Shares
from colocate_runtime.colocated.standing import StandingExports
from colocate_runtime.colocated.transport import LocalBucket

READER = reader_identity("host-a", 41, "r1")
OTHER = reader_identity("host-a", 42, "r2")


class Exporter:
    kind = "Fake"

    def __init__(self) -> None:
        self.released: list[int] = []
        self.freed: list[int] = []

    def release(self, buckets: list[LocalBucket]) -> None:
        self.released += [b.index for b in buckets]

    def free(self, buckets: list[LocalBucket]) -> None:
        self.freed += [b.index for b in buckets]


def step(n: int = 1, *, buckets: int = 3, claimant: str | None = None, **kw: object) -> PendingStep:
    owned = [
        LocalBucket(i, torch.zeros(1, dtype=torch.uint8), {"handle": b"h%d" % i}) for i in range(buckets)
    ]
    return PendingStep(1, n, str(n), owned, 3, buckets, "run", claimant=claimant, **kw)  # type: ignore[arg-type]


def claim(identity: str, n: int) -> str:
    return step_claim(identity, f"proof-{n}")


def ack(**kw: object) -> Ack:
    return Ack(status="ok", ipc_closed=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("opened", "which", "released"),
    [
        (None, Shares.ALL, [0, 1, 2]),
        (None, Shares.UNOPENED, []),  # the ACK did not say: every bucket may have been mapped
        (frozenset({1}), Shares.UNOPENED, [0, 2]),
        (frozenset({1}), Shares.ALL, [0, 1, 2]),
    ],
)
def test_free_gives_back_the_shares_the_move_names(
    opened: frozenset[int] | None, which: Shares, released: list[int]
) -> None:
    exporter, pending = Exporter(), step(opened=opened)
    free(exporter, pending, pending.shares(which))  # type: ignore[arg-type]
    assert exporter.released == released and exporter.freed == [0, 1, 2] and pending.buckets == []
    free(exporter, pending, pending.shares(which))  # type: ignore[arg-type]
    assert exporter.freed == [0, 1, 2]  # once


def test_an_ack_is_noted_on_the_step() -> None:
    pending = step()
    pending.note(Ack(status="error", ipc_closed=False, opened=(2,)))
    assert pending.opened == frozenset({2}) and pending.mapped
    pending.note(ack(opened=None))
    assert pending.opened is None and not pending.mapped


@pytest.mark.parametrize(
    ("parked", "later", "expected"),
    [
        (step(claimant=claim(READER, 1)), ack(reader=claim(READER, 2)), True),
        (step(claimant=claim(READER, 1)), ack(reader=claim(OTHER, 2)), False),  # another reader's word
        (step(claimant=None), ack(reader=claim(OTHER, 2)), True),  # nobody claimed it: no mapping anywhere
        (step(claimant=claim(READER, 1), mapped=True), ack(reader=claim(READER, 2)), False),
        (step(claimant=claim(READER, 1), mapped=True), ack(reader=claim(READER, 2), held=()), True),
        (step(claimant=claim(READER, 1)), ack(reader=claim(READER, 2), held=((1, 1),)), False),
        (step(claimant=claim(READER, 1)), ack(reader=claim(READER, 2), held=((0, 1),)), True),  # other gen
    ],
    ids=[
        "same reader",
        "another reader",
        "unclaimed",
        "close failed, held not said",
        "close failed, held says released",
        "still held",
        "an older generation held",
    ],
)
def test_superseded(parked: PendingStep, later: Ack, expected: bool) -> None:
    assert superseded(parked, later) is expected


def kept_step(*, opened: frozenset[int] | None, layout: object = "layout") -> PendingStep:
    return step(opened=opened, layout=layout, kept=(0, 1))


def test_unopened_kept_exports_stand_for_the_next_step_of_their_layout() -> None:
    exporter = Exporter()
    standing = StandingExports(exporter)  # type: ignore[arg-type]
    pending = kept_step(opened=frozenset({1}))
    standing.keep(pending, ack(kept=(0, 1)))
    # Bucket 0 was read through the kept mapping and not opened: it stands; 1 and 2 are the step's to free.
    assert [b.index for b in pending.buckets] == [1, 2]
    taken = standing.take("layout", keep_mapped=True)  # type: ignore[arg-type]
    assert taken is not None and list(taken.buckets) == [0] and exporter.freed == []
    assert standing.take("layout", keep_mapped=True) is None  # type: ignore[arg-type]  # taken once


@pytest.mark.parametrize(
    ("layout", "keep_mapped"),
    [("another layout", True), ("layout", False)],
    ids=["another layout", "not kept mapped"],
)
def test_standing_exports_another_step_cannot_use_are_retired(layout: str, keep_mapped: bool) -> None:
    exporter = Exporter()
    standing = StandingExports(exporter)  # type: ignore[arg-type]
    standing.keep(kept_step(opened=frozenset()), ack(kept=(0, 1)))
    assert standing.take(layout, keep_mapped=keep_mapped) is None  # type: ignore[arg-type]
    assert exporter.released == [0, 1] and exporter.freed == [0, 1]


@pytest.mark.parametrize(
    ("opened", "ack_kept", "layout"),
    [
        (None, (0, 1), "layout"),
        (frozenset({0, 1}), (0, 1), "layout"),
        (frozenset(), (), "layout"),
        (frozenset(), (0, 1), None),
    ],
    ids=["opened not said", "all opened", "reader kept none", "not an in-place step"],
)
def test_nothing_stands(opened: frozenset[int] | None, ack_kept: tuple[int, ...], layout: object) -> None:
    standing = StandingExports(Exporter())  # type: ignore[arg-type]
    pending = kept_step(opened=opened, layout=layout)
    standing.keep(pending, ack(kept=ack_kept))
    assert len(pending.buckets) == 3 and standing.take(layout, keep_mapped=True) is None  # type: ignore[arg-type]
