"""Tensor views and the staging arena: the only torch the executor needs besides torch.distributed.

Packed buffers are byte ranges of one arena: `pipeline_depth` slots, each sized for the largest chunk that
uses it, reused round-robin. Reuse is safe because a slot is repacked only after the chunk that used it was
drained and unpacked (stream order on CUDA, completed waits on CPU), and nothing is kept from one chunk to the
next: no slice caches, no per-chunk allocations that could pile up.
"""

from __future__ import annotations

import torch

from colocate_runtime.p2p.chunks import aligned
from colocate_runtime.shards import Box, ShardError


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardError(f"unknown dtype {name!r}")
    return dtype


def box_view(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of a local shard that `box` (in the shard's own coordinates) selects."""
    return tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor seen as flat bytes (what travels on the wire; both ends then count the same)."""
    return tensor.reshape(-1).view(torch.uint8)


def typed_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed, shaped window into a byte buffer, starting at an ALIGN-aligned offset."""
    itemsize = dtype.itemsize
    n = 1
    for s in shape:
        n *= s
    return buffer[offset : offset + n * itemsize].view(dtype).view(shape)


class Arena:
    """Byte slots for packed buffers, one allocation for the whole run."""

    def __init__(self, slot_bytes: list[int], device: torch.device) -> None:
        sizes = [aligned(b) for b in slot_bytes]
        self.nbytes = sum(sizes)
        self._storage = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._slots: list[torch.Tensor] = []
        start = 0
        for size in sizes:
            self._slots.append(self._storage[start : start + size])
            start += size

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index % len(self._slots)]

    def release(self) -> None:
        self._slots.clear()
        self._storage = torch.empty(0, dtype=torch.uint8, device=self._storage.device)
