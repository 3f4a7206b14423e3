"""The torch dtype of a dtype name, for every module that turns shard metadata into tensors.

Metadata spells dtypes as strings (`shards.DTYPE_BYTES`, torch's names after "torch.") so planning needs no
torch; this is the one place the names become `torch.dtype`s, with one error for a name outside the table.
"""

from __future__ import annotations

import torch

from colocate_runtime.shards import DTYPE_BYTES, ShardError

# Built once: the converter's hot loop looks a dtype up for every piece of every step.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dtype for name in DTYPE_BYTES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        if name in DTYPE_BYTES:
            raise ShardError(f"this torch has no dtype {name!r}") from None
        raise ShardError(f"unsupported dtype {name!r}; known: {sorted(DTYPE_BYTES)}") from None
