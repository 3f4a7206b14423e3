"""Megatron-core's fused QKV layout and its inverse, on torch tensors.

Megatron stores `linear_qkv` rows as query groups, one per KV head: [q rows of the group's heads; k rows;
v rows]. A TP rank holds whole groups, so its q, k and v are each one contiguous row range of the canonical
q_proj, k_proj and v_proj. The layout is fixed by the group count, never guessed from the row count: for MHA
the grouped and the [Q; K; V] sizes coincide, and guessing (differently for weight and bias) corrupted
models in the seed. Weight and bias go through the same function.
"""

from __future__ import annotations

import torch

from colocate_runtime.convert.errors import ShapeMismatchError

QKV_PARTS = ("q", "k", "v")


def group_rows(queries_per_group: int, head_dim: int) -> tuple[slice, slice, slice]:
    """Row ranges of q, k and v inside one query group."""
    q_rows = queries_per_group * head_dim
    return slice(0, q_rows), slice(q_rows, q_rows + head_dim), slice(q_rows + head_dim, q_rows + 2 * head_dim)


def query_group_part(
    fused: torch.Tensor, groups: int, queries_per_group: int, head_dim: int, part: str
) -> torch.Tensor:
    """The q, k or v rows of every group, in group order: [rows, *trailing] (a copy when groups > 1)."""
    size = (queries_per_group + 2) * head_dim
    if fused.shape[0] != groups * size:
        raise ShapeMismatchError(
            "linear_qkv",
            (groups * size, *fused.shape[1:]),
            tuple(fused.shape),
            f"{groups} query group(s) of {queries_per_group} q + 1 k + 1 v heads of {head_dim} rows",
        )
    return query_group_view(fused, groups, queries_per_group, head_dim, part).reshape(-1, *fused.shape[1:])


def query_group_view(
    fused: torch.Tensor, groups: int, queries_per_group: int, head_dim: int, part: str
) -> torch.Tensor:
    """`query_group_part` without the copy: a [groups, rows per group, *trailing] view of `fused` whose
    row-major order is that part's rows (the one-pass update copies from it directly)."""
    size = (queries_per_group + 2) * head_dim
    rows = group_rows(queries_per_group, head_dim)[QKV_PARTS.index(part)]
    return fused.view(groups, size, *fused.shape[1:])[:, rows]


def split_query_groups(
    fused: torch.Tensor, groups: int, queries_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (query_group_part(fused, groups, queries_per_group, head_dim, part) for part in QKV_PARTS)
    return q, k, v


def fuse_query_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `split_query_groups`: interleave per-group q, k, v rows back into Megatron's layout."""
    trailing = tuple(q.shape[1:])
    parts = [t.reshape(groups, -1, *trailing) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *trailing)
