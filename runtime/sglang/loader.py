"""The SGLang-side entry point of the colocated update: a custom weight loader that runs the reader.

SGLang calls a loader registered with
`--custom-weight-loader colocate_runtime.sglang.loader.load_colocated_step` inside each TP worker, as
`loader(model, named_tensors)`, when `/update_weights_from_tensor` names it as `load_format` (the scheduler
runs it between batches, so no forward pass sees half-updated weights). The request's tensors carry nothing
here (an empty list per rank): the loader reads the trainer's next published step for this GPU from the
meta-store and applies it in place. The configuration comes from the COLOCATE_* environment of the SGLang
container, read once per process.

When SGLang shards the model differently from the trainer, each TP worker also needs slices published on
other GPUs: `set_exchange_resolver` gives the loader a `ReshardExchange` (colocated/exchange.py) over the TP
group. Every TP worker sets both resolvers before the first update, e.g. at import of the module that
`--custom-weight-loader` names (SGLang imports it in each worker):

    tp = sglang.srt.distributed.get_tp_group()   # one rank per GPU, NCCL
    plan = inference_plan(spec, sglang_layout, tp.rank_in_group)
    set_target_resolver(lambda model: {s.name: v for s, v in plan.read(dict(model.named_parameters()))})
    ranks = range(tp.world_size)
    held = (trainer_plan(spec, megatron, trainer_rank_on_gpu(r)).rank_shards(r) for r in ranks)
    trainer = Layout.from_ranks(held)  # under r: the Megatron rank whose shard is published on r's GPU
    inference = Layout.from_ranks(inference_plan(spec, sglang_layout, r).rank_shards(r) for r in ranks)
    device = torch.device("cuda", torch.cuda.current_device())
    set_exchange_resolver(
        lambda model, cfg: reshard_exchange(cfg, trainer, inference, group=tp.device_group, device=device)
    )

Rank r of both layouts is the TP worker of group rank r: the trainer layout names, under r, the trainer shard
published on that worker's GPU. The resolver runs on the first update, on every worker at once (creating the
exchange is collective). Each update is then one collective step: SGLang runs the loader on every TP worker.

The trainer publishes no step before its IPC preflight passed (colocated/preflight.py), and SGLang imports
this loader only at the first update, so each TP worker starts the preflight responder at its own start, in
the same module that sets the resolvers (the SGLang stand-in calls it at startup):

    start_preflight()   # after the worker's CUDA device is set; a no-op when COLOCATE_IPC_PREFLIGHT=Off
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.preflight_reader import PreflightResponder
from colocate_runtime.colocated.reader import WeightReader
from colocate_runtime.colocated.wiring import new_reader, new_responder

if TYPE_CHECKING:
    from colocate_runtime.colocated.exchange import ReshardExchange

LOADER_PATH = "colocate_runtime.sglang.loader.load_colocated_step"
TargetResolver = Callable[[torch.nn.Module], Mapping[str, torch.Tensor]]
ExchangeResolver = Callable[[torch.nn.Module, ColocateConfig], "ReshardExchange | None"]

_lock = threading.Lock()
_readers: dict[int, WeightReader] = {}
_responder: PreflightResponder | None = None
_config: ColocateConfig | None = None
_resolver: TargetResolver | None = None
_exchange_resolver: ExchangeResolver | None = None


def named_parameters(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Default targets: the model's own parameters, by name (canonical names = the model's names)."""
    return dict(model.named_parameters())


def set_target_resolver(resolver: TargetResolver) -> None:
    """Where SGLang's fused layout differs from the canonical names, runtime/convert supplies the views."""
    global _resolver
    _resolver = resolver


def set_exchange_resolver(resolver: ExchangeResolver | None) -> None:
    """Where SGLang's sharding differs from the trainer's: the cross-GPU exchange of this worker (see above).
    Returning None keeps the local-only path."""
    global _exchange_resolver
    _exchange_resolver = resolver


def _tp_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _cfg() -> ColocateConfig:
    global _config
    if _config is None:
        _config = ColocateConfig.from_env(os.environ)
    return _config


def start_preflight(rank: int | None = None) -> PreflightResponder | None:
    """Answer the trainer's IPC preflight from this worker from now on (once per process; see above).
    `rank` as the reader's (the TP rank by default). None when the preflight is Off."""
    global _responder
    with _lock:
        cfg = _cfg()
        if _responder is None and cfg.ipc_preflight != "Off" and cfg.transport != "NCCL":
            device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
            _responder = new_responder(cfg, rank=_tp_rank() if rank is None else rank, device=device)
        return _responder


def reader_for(model: torch.nn.Module) -> WeightReader:
    with _lock:
        reader = _readers.get(id(model))
        if reader is None:
            cfg = _cfg()
            targets = (_resolver or named_parameters)(model)
            device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
            exchange = _exchange_resolver(model, cfg) if _exchange_resolver is not None else None
            preflight = _responder is None  # late: start_preflight was not called at worker start
            if exchange is None:
                reader = new_reader(cfg, targets, rank=_tp_rank(), device=device, preflight=preflight)
            else:
                reader = new_reader(
                    cfg,
                    targets,
                    rank=exchange.rank,
                    device=device,
                    target_shards=exchange.target_shards(),
                    exchange=exchange,
                    preflight=preflight,
                )
            _readers[id(model)] = reader
        return reader


def load_colocated_step(model: torch.nn.Module, named_tensors: Any) -> None:
    """Apply the trainer's next step for this GPU (raises on failure: SGLang then answers success=false)."""
    reader_for(model).apply_next()


def close_all() -> None:
    global _responder
    with _lock:
        for reader in _readers.values():
            reader.close()
        _readers.clear()
        if _responder is not None:
            _responder.stop()
            _responder = None
