"""Typed views of entries inside flat byte buckets, and the dtype names the manifest uses."""

from __future__ import annotations

import torch

from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.shards import DTYPE_BYTES


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch has no dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_view(flat: torch.Tensor, entry: PlacedEntry) -> torch.Tensor:
    """The entry as a tensor of its dtype and shape, aliasing the bucket's bytes (no copy)."""
    raw = flat.narrow(0, entry.offset, entry.nbytes)
    return raw.view(torch_dtype(entry.dtype)).view(entry.shape)
