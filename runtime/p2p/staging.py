"""Tensor views: the only torch the planning side of the executor needs besides torch.distributed.

Packed buffers are byte ranges of one arena (`program.Arena`): `pipeline_depth` slots, each sized for the
largest chunk that uses it, reused round-robin. Reuse is safe because a slot is repacked only after the chunk
that used it was drained and unpacked (stream order on CUDA, completed waits on CPU).
"""

from __future__ import annotations

import torch

from colocate_runtime.shards import Box


def box_view(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of a local shard that `box` (in the shard's own coordinates) selects."""
    return tensor[box.slices()]


def typed_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed, shaped window into a byte buffer, starting at an ALIGN-aligned offset."""
    itemsize = dtype.itemsize
    n = 1
    for s in shape:
        n *= s
    return buffer[offset : offset + n * itemsize].view(dtype).view(shape)
