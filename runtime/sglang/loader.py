"""The SGLang-side entry point of the colocated update: a custom weight loader that runs the reader.

SGLang calls a loader registered with
`--custom-weight-loader colocate_runtime.sglang.loader.load_colocated_step` inside each TP worker, as
`loader(model, named_tensors)`, when `/update_weights_from_tensor` names it as `load_format` (the scheduler
runs it between batches, so no forward pass sees half-updated weights). The request's tensors carry nothing
here (an empty list per rank): the loader reads the trainer's next published step for this GPU from the
meta-store and applies it in place. The configuration comes from the COLOCATE_* environment of the SGLang
container, read once per process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.reader import WeightReader
from colocate_runtime.colocated.wiring import new_reader

LOADER_PATH = "colocate_runtime.sglang.loader.load_colocated_step"
TargetResolver = Callable[[torch.nn.Module], Mapping[str, torch.Tensor]]

_lock = threading.Lock()
_readers: dict[int, WeightReader] = {}
_config: ColocateConfig | None = None
_resolver: TargetResolver | None = None


def named_parameters(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Default targets: the model's own parameters, by name (canonical names = the model's names)."""
    return dict(model.named_parameters())


def set_target_resolver(resolver: TargetResolver) -> None:
    """Where SGLang's fused layout differs from the canonical names, runtime/convert supplies the views."""
    global _resolver
    _resolver = resolver


def _tp_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def reader_for(model: torch.nn.Module) -> WeightReader:
    global _config
    with _lock:
        reader = _readers.get(id(model))
        if reader is None:
            if _config is None:
                _config = ColocateConfig.from_env(os.environ)
            targets = (_resolver or named_parameters)(model)
            device = torch.cuda.current_device() if _config.transport == "CudaIPC" else None
            reader = new_reader(_config, targets, rank=_tp_rank(), device=device)
            _readers[id(model)] = reader
        return reader


def load_colocated_step(model: torch.nn.Module, named_tensors: Any) -> None:
    """Apply the trainer's next step for this GPU (raises on failure: SGLang then answers success=false)."""
    reader_for(model).apply_next()


def close_all() -> None:
    with _lock:
        for reader in _readers.values():
            reader.close()
        _readers.clear()
