"""Optional sampled checksums: the trainer hashes a few entries, the reader the same entries after its copy.

Both sides pick the same entries (a deterministic function of the names and the step) and compute a
position-weighted sum of the raw bytes on the device, so a permutation is caught as well as a wrong value,
and equal bits give equal checksums on any device.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

MAX_SAMPLED_BYTES = 1 << 20
_MOD = 65521


def sample_names(names: Sequence[str], step: int, count: int) -> list[str]:
    """The same `count` names on both sides for a given step, changing from step to step."""
    if count <= 0 or not names:
        return []
    ranked = sorted(names, key=lambda n: zlib.crc32(f"{step}:{n}".encode()))
    return sorted(ranked[:count])


def tensor_checksum(t: torch.Tensor) -> str:
    return tensor_checksums([t])[0]


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[str]:
    """`tensor_checksum` of each, read back from the device at once (one synchronisation, not two each)."""
    sums, sizes = [], []
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n > MAX_SAMPLED_BYTES:
            stride = n // MAX_SAMPLED_BYTES
            flat = flat[::stride][:MAX_SAMPLED_BYTES]
        values = flat.to(torch.int64)
        weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % _MOD + 1
        sums.append(torch.stack([values.sum(), (values * weights).sum()]))
        sizes.append(n)
    if not sums:
        return []
    read = torch.stack([s.to(sums[0].device) for s in sums]).tolist()
    return [f"{n}:{plain}:{weighted}" for n, (plain, weighted) in zip(sizes, read, strict=True)]
