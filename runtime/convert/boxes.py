"""Where one rank's shard of a canonical tensor lies, for the three ways weights are split.

Splits must be exact: an uneven split would silently disagree with what Megatron or SGLang allocate.
"""

from __future__ import annotations

from collections.abc import Sequence

from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.layout import Group
from colocate_runtime.shards import Box


def split_box(name: str, shape: Sequence[int], dim: int, group: Group) -> Box:
    """The group rank's equal slab of `shape` along `dim` (column- or row-parallel linear layers)."""
    if shape[dim] % group.size:
        raise UnsupportedLayoutError(
            f"{name}: dimension {dim} of size {shape[dim]} does not split over {group.size} ranks"
        )
    length = shape[dim] // group.size
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = group.rank * length, length
    return Box(tuple(offsets), tuple(lengths))


def vocab_box(name: str, shape: Sequence[int], padded_rows: int, group: Group) -> Box | None:
    """Rows of a vocab-parallel tensor that hold real tokens: both sides pad the vocabulary (differently),
    split the padded rows evenly, and the padding never leaves the rank. None: the rank holds only padding."""
    vocab = shape[0]
    if padded_rows < vocab or padded_rows % group.size:
        raise UnsupportedLayoutError(
            f"{name}: {padded_rows} padded rows do not split over {group.size} ranks"
        )
    per_rank = padded_rows // group.size
    start = group.rank * per_rank
    end = min(start + per_rank, vocab)
    if end <= start:
        return None
    return Box((start, *(0 for _ in shape[1:])), (end - start, *shape[1:]))


def heads_box(
    name: str, num_heads: int, head_dim: int, trailing: Sequence[int], group: Group, replicate: bool
) -> Box:
    """Rows of whole attention heads. With `replicate` (SGLang's KV heads), a group larger than the head count
    gives each head to `size / heads` consecutive ranks, as QKVParallelLinear does."""
    if num_heads % group.size == 0:
        per_rank = num_heads // group.size
        first = group.rank * per_rank
    elif replicate and group.size % num_heads == 0:
        per_rank = 1
        first = group.rank // (group.size // num_heads)
    else:
        supported = "divide or be a multiple of" if replicate else "divide"
        raise UnsupportedLayoutError(
            f"{name}: {num_heads} heads cannot be split over attention TP {group.size} (TP must {supported} "
            f"the head count)"
        )
    return Box((first * head_dim, *(0 for _ in trailing)), (per_rank * head_dim, *trailing))
