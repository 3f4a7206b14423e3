"""`COLOCATE_DUMP_INSTALLED_DIR`: what a TP worker installed, saved after every step.

A debugging aid ("what does the engine hold now?"), and how the tests compare SGLang's parameters with the
trainer's bit for bit where SGLang has no API that returns them (its Qwen3 has no `get_weights_by_name`).
Each file holds, per canonical tensor, the box this worker holds (None: the whole tensor) and a CPU copy of
those elements read back from SGLang's own parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from colocate_runtime.contract import env
from colocate_runtime.shards import TensorShard


def dump_folder(environ: Mapping[str, str] = os.environ) -> Path | None:
    folder = env.DUMP_INSTALLED_DIR.read(environ)
    return None if not folder else Path(str(folder))


def dump_installed(
    folder: Path,
    step: int,
    rank: int,
    targets: Mapping[str, torch.Tensor],
    shards: Mapping[str, TensorShard] | None,
) -> Path:
    pieces = {
        name: (shards[name].box.to_json() if shards and name in shards else None, t.detach().cpu().clone())
        for name, t in targets.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"installed-step-{step}-rank-{rank}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(pieces, tmp)
    tmp.replace(path)  # a reader of the folder never sees half a file
    return path
