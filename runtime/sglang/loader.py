"""The SGLang-side entry point of the colocated update: a custom weight loader that runs the reader.

SGLang calls a loader registered with
`--custom-weight-loader colocate_runtime.sglang.loader.load_colocated_step` inside each TP worker (scheduler
process), as `loader(model, named_tensors)`, when `/update_weights_from_tensor` names it as `load_format`
(the scheduler runs it between batches, so no forward pass sees half-updated weights). The request's tensors
carry nothing here (an empty list per rank): the loader reads the trainer's next published step for this GPU
from the meta-store and applies it in place, then runs the model's own `post_load_weights` (what SGLang runs
after a load that bypasses `model.load_weights`: MLA's `w_kc`/`w_vc` and the like are derived there) before
the step's ACK. The configuration comes from the COLOCATE_* environment of the SGLang container, read once per
process.

**It never raises into SGLang.** SGLang does not catch a custom loader's exception: the scheduler logs it and
sends SIGQUIT to the server, which dies. A failed step is therefore logged and reported through the
meta-store (the reader's error ACK, or a `failed` step event when no step was claimed); the trainer learns it
from its writer (`wait_and_free` raises), and `ColocatedRollout.install_weights` keeps generation paused.

**Start.** The trainer publishes no step before its IPC preflight passed (colocated/preflight.py), so each TP
worker must answer the preflight before the first update, while SGLang imports a custom loader only at the
first update. Two ways start the responder at worker start, both idempotent:
- SGLang >= 0.5.11: our `sglang.srt.plugins` entry point (plugin.py) runs in every scheduler process;
- every version: `ColocatedRollout.start()` calls `/update_weights_from_tensor` once with
  `load_format=colocate_runtime.sglang.loader.start_colocated` (list it in `--custom-weight-loader` too).

**Ranks.** The reader's rank is the worker's rank in SGLang's TP group (not the global rank, which counts
pipeline stages too).

**What is automatic.** `--custom-weight-loader colocate_runtime.sglang.loader.load_colocated_step
colocate_runtime.sglang.loader.start_colocated` is all a job adds to SGLang's command line, with no module of
its own: at the first update every TP worker builds its targets itself (auto.py), from the trainer record that
the trainer facade (`colocate_runtime.megatron`) writes under this GPU's UUID at its start (the Megatron
layout, the rank's coordinates, the dtype and the architecture it publishes), SGLang's own model config
(`model.config`) and SGLang's own server arguments (TP, `--ep-size`, DP attention, `--enable-dp-lm-head`,
`--moe-dense-tp-size`). The targets are views of SGLang's fused parameters (`inference_plan(...).read`),
checked against the model. The workers then decide together (all-gathering every GPU's trainer shards and
targets over the CPU group of SGLang's TP group): when each worker's targets lie inside what the trainer
publishes on its own GPU, each reads only its GPU's buckets; otherwise (different TP sizes, Megatron's
vocabulary padding to make_vocab_size_divisible_by x TP against SGLang's 64, pipeline stages) the slices held
by other GPUs arrive through a `ReshardExchange` (colocated/exchange.py) over a process group of its own, so a
failed exchange cannot poison SGLang's inference group. One log line per worker says which path and why. A
failure on any worker (no record on its GPU, another architecture, a layout the converters cannot place) fails
that step on every worker with the reason in its error ACK (the trainer's writer raises it), and the next
update wires again.

Each update is one collective step: SGLang runs the loader on every TP worker at once; the first one also
creates, on the exchange path, the exchange's own group (`exchange_group()`) and the exchange.

Without any trainer record for the engine's GPUs, the targets are SGLang's parameters by name
(`named_parameters`): for a trainer that publishes SGLang's own names and shapes. A trainer that publishes
something else without the facade may still set `set_target_resolver` / `set_exchange_resolver` from a module
it lists in `--custom-weight-loader` (imported in each worker before the first update); resolvers it sets
win over the automatic wiring.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.exchange_seam import ExchangeRequest
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.preflight_reader import PreflightResponder
from colocate_runtime.colocated.reader import WeightReader
from colocate_runtime.colocated.wiring import connect, importer_for, new_reader, new_responder
from colocate_runtime.sglang.auto import AutoWiring, AutoWiringError, Worker, automatic_wiring
from colocate_runtime.sglang.dump import dump_folder, dump_installed

if TYPE_CHECKING:
    from colocate_runtime.colocated.exchange import ReshardExchange

log = logging.getLogger(__name__)

LOADER_PATH = "colocate_runtime.sglang.loader.load_colocated_step"
INIT_LOADER_PATH = "colocate_runtime.sglang.loader.start_colocated"
TargetResolver = Callable[[torch.nn.Module], Mapping[str, torch.Tensor]]
ExchangeResolver = Callable[[torch.nn.Module, ColocateConfig], "ReshardExchange | None"]

_lock = threading.Lock()
_readers: dict[int, WeightReader] = {}
_responder: PreflightResponder | None = None
_config: ColocateConfig | None = None
_resolver: TargetResolver | None = None
_exchange_resolver: ExchangeResolver | None = None
_exchange_group: torch.distributed.ProcessGroup | None = None
_engine_instance: int | None = None  # this process's engine instance (register_engine)


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
    """This worker's rank in SGLang's TP group (the global rank also counts pipeline stages)."""
    tp = _sglang_tp_group()
    if tp is not None:
        return int(tp.rank_in_group)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()  # outside SGLang (tests): one group
    return 0


def _sglang_tp_group() -> Any:
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group  # type: ignore[import-not-found]

        return get_tp_group()
    except (ImportError, AssertionError, AttributeError):  # not in an SGLang worker
        return None


def exchange_group() -> torch.distributed.ProcessGroup:
    """A process group of the worker's TP ranks for the cross-GPU exchange, created once, on first use, by
    every worker at once (a collective over SGLang's whole world: one new group per TP group, in order).
    Outside SGLang (tests) with torch.distributed initialized: one group of the whole world."""
    global _exchange_group
    if _exchange_group is None:
        tp = _sglang_tp_group()
        if tp is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise RuntimeError(
                    "exchange_group() runs inside an SGLang TP worker (no SGLang TP group here)"
                )
            world = torch.distributed.get_world_size()
            _exchange_group = torch.distributed.new_group(ranks=list(range(world)))
            return _exchange_group
        size, world = int(tp.world_size), torch.distributed.get_world_size()
        backend = torch.distributed.get_backend(tp.device_group)
        for first in range(0, world, size):
            ranks = list(range(first, first + size))
            group = torch.distributed.new_group(ranks=ranks, backend=backend)
            if list(tp.ranks) == ranks:
                _exchange_group = group
        if _exchange_group is None:
            raise RuntimeError(
                f"SGLang's TP group {list(tp.ranks)} is not a contiguous block of {size} ranks"
            )
    return _exchange_group


def _decision_group() -> torch.distributed.ProcessGroup | None:
    """The CPU (gloo) group the TP workers decide the automatic wiring over: SGLang's own `cpu_group` of the
    TP group (the loader runs while every worker handles the same update request, so its few all-gathers
    are in step), or the exchange group outside SGLang; None in a process alone."""
    tp = _sglang_tp_group()
    if tp is not None:
        return tp.cpu_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return exchange_group()
    return None


def _cfg() -> ColocateConfig:
    global _config
    if _config is None:
        _config = ColocateConfig.from_env(os.environ)
    return _config


def register_engine(rank: int | None = None) -> int | None:
    """Say in the meta-store that a new SGLang-side process serves this worker's GPU, once per process: the
    trainer pushes its current weights to it again (colocated/repush.py). Its engine instance number; None
    where the colocated path is not used (NCCL). Called at worker start (plugin or init call) and at the
    first update."""
    global _engine_instance
    with _lock:
        cfg = _cfg()
        if _engine_instance is None and cfg.transport != "NCCL":
            device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
            uuid = importer_for(cfg, rank=_tp_rank() if rank is None else rank, device=device).device_uuid()
            _engine_instance = connect(cfg).register_engine(uuid)
            log.info("colocated: engine instance %d on %s", _engine_instance, uuid)
        return _engine_instance


def start_preflight(rank: int | None = None) -> PreflightResponder | None:
    """Answer the trainer's IPC preflight from this worker from now on (once per process; see above).
    `rank` as the reader's (the TP rank by default). None when the preflight is Off."""
    global _responder
    register_engine(rank)
    with _lock:
        cfg = _cfg()
        if _responder is None and cfg.ipc_preflight != "Off" and cfg.transport != "NCCL":
            device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
            _responder = new_responder(cfg, rank=_tp_rank() if rank is None else rank, device=device)
        return _responder


def _post_load(model: torch.nn.Module) -> Callable[[], None] | None:
    """SGLang's own post-load step of the model, when it has one (derived tensors such as MLA's w_kc)."""
    hook = getattr(model, "post_load_weights", None)
    return hook if callable(hook) else None


def reader_for(model: torch.nn.Module) -> WeightReader:
    """This worker's reader, built at its first update (collectively, when it is wired automatically)."""
    try:
        register_engine()  # neither the plugin nor the init call ran in this process
    except Exception as err:
        log.warning("colocated: engine instance not registered (%s); a restart is not re-pushed", err)
    with _lock:
        reader = _readers.get(id(model))
        if reader is None:
            reader = _new_reader(model, _cfg())
            _readers[id(model)] = reader
        return reader


def _new_reader(model: torch.nn.Module, cfg: ColocateConfig) -> WeightReader:
    """User resolvers first; else the automatic wiring when a trainer record exists; else SGLang's own
    parameters by name (the trainer publishes SGLang's names)."""
    device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
    preflight = _responder is None  # late: start_preflight was not called at worker start
    finalize = _post_load(model)
    rank = _tp_rank()
    if _resolver is None and _exchange_resolver is None:
        try:
            wired = _automatic(model, cfg, rank, device)
        except Exception as err:
            why = str(err) if isinstance(err, AutoWiringError) else f"{type(err).__name__}: {err}"
            if not isinstance(err, AutoWiringError):  # not agreed by the workers (creating the exchange)
                why = f"automatic colocated wiring failed on worker {rank}: {why}"
            log.error("colocated loader: %s", why)
            # Each worker answers this step with why (an error ACK, which the trainer's writer raises), and
            # the next update wires again (a trainer may start late).
            refusal = _Refusal(why)
            return new_reader(cfg, {}, rank=rank, device=device, exchange=refusal, preflight=preflight)
        if wired is not None:
            fp8 = {"scales": wired.scales, "fp8_format": wired.fp8_format} if wired.fp8_format else {}
            reader = new_reader(
                cfg,
                wired.targets,
                rank=rank,
                device=device,
                target_shards=wired.target_shards,
                exchange=wired.exchange,
                preflight=preflight,
                finalize=finalize,
                **fp8,
            )
            if wired.exchange is None:
                # The local path copies what this GPU's trainer rank publishes; whole tensors it holds for
                # no target here (experts of other EP ranks) are not an error.
                reader.settings = replace(reader.settings, allow_extra_entries=True)
            return reader
    targets = (_resolver or named_parameters)(model)
    exchange = _exchange_resolver(model, cfg) if _exchange_resolver is not None else None
    if exchange is None:
        return new_reader(cfg, targets, rank=rank, device=device, preflight=preflight, finalize=finalize)
    return new_reader(
        cfg,
        targets,
        rank=exchange.rank,
        device=device,
        target_shards=exchange.target_shards(),
        exchange=exchange,
        preflight=preflight,
        finalize=finalize,
    )


def _automatic(
    model: torch.nn.Module, cfg: ColocateConfig, rank: int, device: int | None
) -> AutoWiring | None:
    """Collective over the TP workers (auto.py): None when no GPU of this engine has a trainer record."""
    group = _decision_group()
    uuid = importer_for(cfg, rank=rank, device=device).device_uuid()
    where = torch.device("cuda", device) if device is not None else None
    worker = Worker(rank, group, where, uuid, exchange_group if group is not None else None)
    store = connect(cfg)
    try:
        return automatic_wiring(model, cfg, store, worker)
    finally:
        store.close()


class _Refusal:
    """The exchange seam of a reader that can only refuse (its wiring failed): it takes the step, copies
    nothing and fails it with why, so the trainer learns the reason from the step's error ACK rather than
    from a timeout."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self, request: ExchangeRequest) -> set[str]:
        raise StepFailed(self.why, step=request.manifest.step)

    def abandon(self, error: BaseException) -> None:
        """No peers wait on a refusal."""


def _drop_if_refusing(model: torch.nn.Module, reader: WeightReader) -> None:
    if isinstance(reader.exchange, _Refusal):
        with _lock:
            _readers.pop(id(model), None)
        reader.close()


def load_colocated_step(model: torch.nn.Module, named_tensors: Any) -> None:
    """Apply the trainer's next step for this GPU. Never raises (see above): a failure is logged and reported
    through the meta-store, and SGLang answers success, so the trainer's writer is the judge of the step."""
    try:
        reader = reader_for(model)
    except Exception as err:
        log.exception("colocated loader: no reader on this worker (%s); the step is not applied", err)
        return
    try:
        report = reader.apply_next()
        if (folder := dump_folder()) is not None:
            dump_installed(folder, report.step, _tp_rank(), reader.targets, reader.target_shards)
    except Exception as err:
        # A failure inside a claimed step is already in its error ACK and step events; one before any claim
        # (no step published in time, trainer lost) only in this log line and the reader's heartbeat state.
        log.error(
            "colocated loader: step not applied on rank %d: %s: %s", _tp_rank(), type(err).__name__, err
        )
    try:
        _drop_if_refusing(model, reader)
    except Exception as err:
        log.warning("colocated loader: the refusing reader did not close cleanly (%s)", err)


def start_colocated(model: torch.nn.Module, named_tensors: Any) -> None:
    """The init call (`ColocatedRollout.start()`): start this worker's preflight responder. Never raises."""
    try:
        t0 = time.perf_counter()
        start_preflight()
        log.info("colocated: worker %d ready in %.3f s", _tp_rank(), time.perf_counter() - t0)
    except Exception as err:
        log.exception("colocated: preflight responder not started (%s)", err)


def close_all() -> None:
    global _responder
    with _lock:
        for reader in _readers.values():
            reader.close()
        _readers.clear()
        if _responder is not None:
            _responder.stop()
            _responder = None
