"""Typed views of entries inside flat byte buckets, the dtype names the manifest uses, and the device name
the copy programs compare tensors against."""

from __future__ import annotations

import torch

from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import DTYPE_BYTES


def indexed(device: torch.device | None) -> torch.device | None:
    """`cuda` as `cuda:<current>`: tensors always carry an index, and `cuda != cuda:0` in torch."""
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_view(flat: torch.Tensor, entry: PlacedEntry) -> torch.Tensor:
    """The entry as a tensor of its dtype and shape, aliasing the bucket's bytes (no copy; an in-place entry
    whose view is not of its shape, such as Megatron's interleaved q/k/v, is copied into that shape)."""
    if entry.view is None:
        raw = flat.narrow(0, entry.offset, entry.nbytes)
        return raw.view(torch_dtype(entry.dtype)).view(entry.shape)
    shape, strides = entry.view
    base = flat.narrow(0, 0, flat.numel() - flat.numel() % DTYPE_BYTES[entry.dtype])
    typed = base.view(torch_dtype(entry.dtype))
    offset = typed.storage_offset() + entry.offset // DTYPE_BYTES[entry.dtype]
    return typed.as_strided(shape, strides, offset).reshape(entry.shape)
