"""`Box.difference` and `Box.slices` (the box arithmetic the reader and the executor index tensors with) and
`dtypes.torch_dtype` (the one place a shard's dtype name becomes a torch dtype)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import DTYPE_BYTES, Box, ShardError


def boxes(ndim: int) -> st.SearchStrategy[Box]:
    extent = st.tuples(*[st.integers(0, 6)] * ndim)
    return st.builds(Box, extent, extent)


pairs = st.integers(0, 3).flatmap(lambda ndim: st.tuples(boxes(ndim), boxes(ndim)))


def points(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))))


@given(pairs)
def test_difference_tiles_what_lies_outside_the_other_box(pair: tuple[Box, Box]) -> None:
    box, other = pair
    pieces = box.difference(other)
    covered = [points(p) for p in pieces]
    assert all(covered), f"an empty piece in {pieces}"
    assert len(pieces) <= 2 * box.ndim or other.intersect(box) is None
    for a, b in itertools.combinations(covered, 2):
        assert not a & b, f"pieces overlap: {pieces}"
    assert set().union(*covered) == points(box) - points(other)


def test_difference_of_a_centred_hole_is_four_slabs() -> None:
    box = Box((0, 0), (4, 6))
    pieces = box.difference(Box((1, 2), (2, 2)))
    assert pieces == (
        Box((0, 0), (1, 6)),  # rows above the hole
        Box((3, 0), (1, 6)),  # rows below it
        Box((1, 0), (2, 2)),  # left of it, within its rows
        Box((1, 4), (2, 2)),  # right of it
    )


def test_difference_without_overlap_or_with_a_cover() -> None:
    box = Box((2, 2), (2, 2))
    assert box.difference(Box((0, 0), (2, 2))) == (box,)
    assert box.difference(Box((0, 0), (8, 8))) == ()
    assert box.difference(box) == ()


def test_slices_select_the_box() -> None:
    grid = [[10 * r + c for c in range(5)] for r in range(4)]
    rows, cols = Box((1, 2), (2, 3)).slices()
    assert [row[cols] for row in grid[rows]] == [[12, 13, 14], [22, 23, 24]]


def test_torch_dtype_maps_every_shard_dtype_and_names_an_unknown_one() -> None:
    for name, nbytes in DTYPE_BYTES.items():
        assert torch_dtype(name).itemsize == nbytes, name
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ShardError, match=r"unsupported dtype 'bfloat17'; known: \["):
        torch_dtype("bfloat17")
