"""slime's weight-updater contract on the colocated path (as of slime 624b824a, THUDM/slime 2026-08-21).

slime's Megatron actor (`slime/backends/megatron_utils/actor.py`) builds one updater per trainer rank as
`cls(args, model, weights_getter=..., model_name=..., quantization_config=...)`, sets its `weight_version`,
and then per sync calls, on every rank:

    updater.connect_rollout_engines(engines, lock, engine_gpu_counts=..., engine_gpu_offsets=...,
                                    engine_parallel_configs=...)   # first sync, and when engines are new
    updater.update_weights()                                        # every sync
    updater.pop_metrics()                                           # after each train step, for logging

`UpdateWeightFromColocate` keeps that contract and slime's order against the engines (what slime's own
`UpdateWeightFromTensor.update_weights` does): `weight_version += 1`; global rank 0 pauses generation on
every engine and flushes their caches; all ranks meet; the weights move; all ranks meet; rank 0 continues
generation. Only the middle differs: instead of gathering each TP group's tensors, converting them to HF
names, packing a flattened bucket per engine and sending it through Ray, every rank publishes its own
parameters where they lie (the DDP buffers) through `colocate_runtime.megatron.Publisher`, and the first
rank of each engine's GPU range (slime's `ipc_gather_src`) asks its engine, through slime's own
`SGLangEngine.update_weights_from_tensor(serialized_named_tensors, load_format, flush_cache, weight_version)`,
to run our loader, which reads the step from the meta-store and writes it in place. Every phase ends with an
agreement over the ranks (a gloo group of the Publisher's own): a failure anywhere raises `RankFailed` on
every rank with the same message, and the engines stay paused (nothing is served from half-written weights);
the engine's weight version is set only after every rank confirmed the step.

What is supported: the trainer's weights published from its DDP buffers, so slime must not offload the
trainer (`--no-offload-train`; slime turns offloading on with `--colocate`): with `--offload-train` the
trainer's GPU memory is paused by torch_memory_saver while slime syncs (its weights then live only in slime's
pinned CPU backup), and the trainer must not run under torch_memory_saver's LD_PRELOAD hook at all, so
nothing this updater maps or allocates lies in a torch_memory_saver region. Both are refused at construction
with the flag to change (`UnsupportedSlimeSetup`). Also refused: quantized rollout weights
(`quantization_config`: the published tensors are the trained dtype), and engines not colocated with the
trainer (slime's "distributed" engines beyond the actor's GPUs: use slime's own updater for those).

The SGLang engines must have been started with our loader (`--custom-weight-loader
colocate_runtime.sglang.loader.load_colocated_step colocate_runtime.sglang.loader.start_colocated`) and the
job's COLOCATE_* environment, which the trainer's Ray workers need as well (docs/slime.md).
"""

from __future__ import annotations

import logging
import os
import time
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.megatron.agree import Agreement
from colocate_runtime.megatron.publisher import AGREE_MARGIN_S, Publisher
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, StepNotInstalled

log = logging.getLogger(__name__)

TMS_HOOK = "torch_memory_saver_hook_mode_preload"  # the LD_PRELOAD library slime sets under --offload-train


class UnsupportedSlimeSetup(ValueError):
    """slime's arguments ask for something this updater does not do; the message names the flag."""


def check_slime_args(args: Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, before any model is built, what the colocated updater cannot do (see the module docstring)."""
    environ = os.environ if environ is None else environ
    if getattr(args, "offload_train", False):
        raise UnsupportedSlimeSetup(
            "the colocated weight updater publishes the trainer's weights from its DDP buffers, which "
            "--offload-train pauses (torch_memory_saver) while slime syncs: pass --no-offload-train "
            "(slime turns it on with --colocate); SGLang still releases its memory for training "
            "(--offload-rollout)"
        )
    if TMS_HOOK in environ.get("LD_PRELOAD", "") or environ.get("TMS_INIT_ENABLE") == "1":
        raise UnsupportedSlimeSetup(
            "this trainer process runs under torch_memory_saver's LD_PRELOAD hook (slime sets it with "
            "--offload-train): the colocated updater shares its buffers over CUDA IPC and must not allocate "
            "in a torch_memory_saver region; start the trainer without it (--no-offload-train)"
        )
    if environ.get("SLIME_ENABLE_EXPANDABLE_SEGMENTS") == "1":
        raise UnsupportedSlimeSetup(
            "SLIME_ENABLE_EXPANDABLE_SEGMENTS=1 makes slime's trainer allocate from expandable segments, "
            "which CUDA IPC cannot export: unset it (slime's default is 0)"
        )
    if getattr(args, "update_weight_mode", "full") != "full":
        raise UnsupportedSlimeSetup(
            f"--update-weight-mode {args.update_weight_mode} is not the colocated updater's (full updates)"
        )


def _ray_get(refs: Any) -> Any:
    import ray  # the trainer's Ray worker has it; this module does not need it otherwise

    return ray.get(refs)


class RayEngineRollout:
    """The Publisher's engine side for a rank that drives one slime engine through its Ray actor handle:
    what `ColocatedRollout` does over HTTP, through slime's `SGLangEngine` methods. Pausing, flushing and
    continuing stay with the updater (slime's order: rank 0, every engine); memory release and resume stay
    with slime's rollout manager (`offload` / `onload_weights` / `onload_kv`)."""

    def __init__(self, engine: Any, tp_size: int, get: Callable[[Any], Any] = _ray_get) -> None:
        self.engine = engine
        self.tp_size = tp_size
        self.get = get

    def _update(self, load_format: str, weight_version: str | None) -> Any:
        return self.get(
            self.engine.update_weights_from_tensor.remote(
                serialized_named_tensors=[EMPTY_PAYLOAD] * self.tp_size,
                load_format=load_format,
                flush_cache=False,
                weight_version=weight_version,
            )
        )

    def start(self) -> None:
        """Every TP worker starts answering the trainer's IPC preflight (the init loader; idempotent)."""
        self._update(INIT_LOADER_PATH, None)

    def before_training(self) -> None:
        """Nothing: slime paused and flushed every engine before `update_weights` reached the Publisher."""

    def install_weights(self, weight_version: str, *, confirm: Callable[[], Any]) -> Any:
        # SGLang answers success whatever the loader met; `confirm` (every rank's outcome) is the judge.
        self._update(LOADER_PATH, None)
        try:
            outcome = confirm()
        except Exception as err:
            raise StepNotInstalled(
                f"weights {weight_version!r} not installed ({type(err).__name__}: {err}); generation stays "
                "paused: call update_weights again"
            ) from err
        # The engine reports the version only once every rank confirmed it (the init loader copies nothing).
        self._update(INIT_LOADER_PATH, weight_version)
        return outcome


class UpdateWeightFromColocate:
    """slime's updater contract (connect_rollout_engines, update_weights, pop_metrics, weight_version) on
    the colocated path. Collective: every trainer rank constructs it and calls each method at once."""

    def __init__(
        self,
        args: Namespace,
        model: Sequence[torch.nn.Module],
        weights_getter: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        *,
        model_name: str | None = None,
        quantization_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        ray_get: Callable[[Any], Any] = _ray_get,
        publisher_factory: Callable[..., Publisher] = Publisher,
    ) -> None:
        """The signature slime's actor calls (`weights_getter`, slime's CPU backup, is not read: the weights
        are published from the DDP buffers). `environ`, `ray_get`, `publisher_factory`: for tests."""
        self.environ = os.environ if environ is None else environ
        check_slime_args(args, self.environ)
        if quantization_config:
            raise UnsupportedSlimeSetup(
                f"quantized rollout weights ({quantization_config.get('quant_method')!r}) are not supported "
                "by the colocated updater: it publishes the trained dtype"
            )
        self.args = args
        self.model = list(model)
        self.weights_getter = weights_getter
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.rank = dist.get_rank()
        self.weight_version = 0
        self.get = ray_get
        self.publisher_factory = publisher_factory
        self.publisher: Publisher | None = None
        self.rollout_engines: list[Any] = []
        self.rollout: RayEngineRollout | None = None  # set on the first rank of an engine's GPU range
        self.update_weight_metrics: dict[str, float] = {}
        cfg = ColocateConfig.from_env(self.environ)
        self.agree = Agreement(cfg.step_timeout_s + AGREE_MARGIN_S)

    # --- slime's contract ---------------------------------------------------------------------------------

    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        engine_parallel_configs: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Collective. Maps this rank to its engine as slime does (engine i serves global ranks
        [offset_i, offset_i + count_i)), has each engine's first rank start the engine's colocated side, and
        on the first call starts the Publisher (its writer's IPC preflight needs the engines' workers)."""
        error: BaseException | None = None
        try:
            self._map_engines(rollout_engines, engine_gpu_counts, engine_gpu_offsets, engine_parallel_configs)
            if self.rollout is not None:
                self.rollout.start()
        except Exception as err:
            error = err
        self.agree.check("connecting the colocated rollout engines", error)
        if self.publisher is None:
            # engine=False: no rank speaks HTTP on its own; the engine's first rank installs through Ray.
            self.publisher = self.publisher_factory(
                self.model, hf_config=self.args.hf_checkpoint, environ=self.environ, engine=False
            )
        self.publisher.rollout = self.rollout  # type: ignore[assignment]  # duck-typed ColocatedRollout

    def update_weights(self) -> None:
        """Collective: slime's pause / flush, the colocated step, slime's continue. Raises RankFailed on every
        rank when any rank or engine failed (the engines then stay paused; calling it again retries)."""
        self.weight_version += 1
        version = self.weight_version
        if self.publisher is None:
            raise RuntimeError("update_weights before connect_rollout_engines")
        error: BaseException | None = None
        t0 = time.perf_counter()
        if self.rank == 0:
            try:
                self.get([engine.pause_generation.remote() for engine in self.rollout_engines])
                self.get([engine.flush_cache.remote() for engine in self.rollout_engines])
            except Exception as err:
                error = err
        self.agree.check("pausing and flushing the rollout engines", error)
        t1 = time.perf_counter()
        report = self.publisher.update(version, weight_version=str(version))
        t2 = time.perf_counter()
        if self.rank == 0:
            try:
                self.get([engine.continue_generation.remote() for engine in self.rollout_engines])
            except Exception as err:
                error = err
        self.agree.check("continuing generation", error)
        self.update_weight_metrics = {
            "update_weights/colocate_pause_seconds": t1 - t0,
            "update_weights/colocate_step_seconds": t2 - t1,
            "update_weights/colocate_seconds": time.perf_counter() - t0,
            "update_weights/colocate_bytes": float(report.bytes),
        }

    def pop_metrics(self) -> dict[str, float]:
        out, self.update_weight_metrics = self.update_weight_metrics, {}
        return out

    # --- end ----------------------------------------------------------------------------------------------

    def finish(self, *, ok: bool = True, error: str = "") -> None:
        """The job's final record (every rank; the operator reports success only after it)."""
        if self.publisher is not None:
            self.publisher.finish(ok=ok, error=error)

    # --- helpers ------------------------------------------------------------------------------------------

    def _map_engines(
        self,
        engines: Sequence[Any],
        counts: Sequence[int] | None,
        offsets: Sequence[int] | None,
        parallel: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        per_engine = self.args.rollout_num_gpus_per_engine
        counts = list(counts) if counts is not None else [per_engine] * len(engines)
        if offsets is None:  # slime's fallback: engines packed densely
            offsets = [sum(counts[:i]) for i in range(len(counts))]
        actor_gpus = self.args.actor_num_nodes * self.args.actor_num_gpus_per_node
        beyond = [i for i, (o, c) in enumerate(zip(offsets, counts, strict=True)) if o + c > actor_gpus]
        if beyond:
            raise UnsupportedSlimeSetup(
                f"engines {beyond} lie beyond the trainer's {actor_gpus} GPUs (slime's distributed engines): "
                "the colocated updater serves only engines on the trainer's GPUs"
            )
        for i, config in enumerate(parallel or []):
            dp = int((config or {}).get("dp_size", 1) or 1)
            if dp > 1:
                raise UnsupportedSlimeSetup(f"engine {i} runs {dp} data-parallel replicas: one per server")
        mine = [i for i, (o, c) in enumerate(zip(offsets, counts, strict=True)) if o <= self.rank < o + c]
        if not mine:
            raise UnsupportedSlimeSetup(
                f"trainer rank {self.rank} lies on no engine's GPUs (offsets {list(offsets)}, counts "
                f"{counts}): every trainer rank's weights are read by the engine worker on its GPU"
            )
        self.rollout_engines = list(engines)
        first = offsets[mine[0]] == self.rank
        self.rollout = RayEngineRollout(engines[mine[0]], counts[mine[0]], self.get) if first else None
