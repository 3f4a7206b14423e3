"""Build a process's writer or reader from its `ColocateConfig` (the one place that picks a transport)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from colocate_runtime.colocated.config import ColocateConfig, ConfigError
from colocate_runtime.colocated.exchange_seam import Exchange
from colocate_runtime.colocated.fp8_block import BlockFp8
from colocate_runtime.colocated.fp8_copy import FP32_SCALES
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.liveness import host_id
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.colocated.preflight import PreflightSettings
from colocate_runtime.colocated.preflight_reader import PreflightResponder
from colocate_runtime.colocated.reader import ReaderSettings, WeightReader
from colocate_runtime.colocated.transport import BucketExporter, BucketImporter
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.shards import TensorShard

if TYPE_CHECKING:
    import torch.distributed as dist

    from colocate_runtime.colocated.exchange import ReshardExchange
    from colocate_runtime.p2p.config import ExecutorConfig
    from colocate_runtime.p2p.layout import Layout

# How much longer than a reader's step timeout a rank waits for its peers in the exchange: a peer may reach
# the step (or give up on it) up to one step timeout after this rank.
AGREE_MARGIN_S = 10.0


def connect(cfg: ColocateConfig) -> MetaStore:
    return MetaStore.connect(
        cfg.metastore,
        KeySchema(cfg.namespace, cfg.job),
        key_ttl_s=cfg.key_ttl_s,
        summary_gpus=cfg.step_summary_gpus,
    )


def cpu_device_id(cfg: ColocateConfig, rank: int) -> str:
    """What stands in for a GPU UUID on the shared-memory path: one per host, pod and rank."""
    return f"CPU-{host_id()}-{cfg.replica_index}-{rank}"


def _colocated_only(cfg: ColocateConfig) -> None:
    if cfg.transport == "NCCL":
        raise ConfigError(
            "COLOCATE_TRANSPORT=NCCL moves weights with runtime/p2p, not the colocated writer/reader"
        )


def exporter_for(
    cfg: ColocateConfig, *, rank: int = 0, device: torch.device | int | None = None
) -> BucketExporter:
    _colocated_only(cfg)
    if cfg.transport == "CudaIPC":
        from colocate_runtime.colocated.ipc import CudaIpcExporter

        return CudaIpcExporter(device)
    from colocate_runtime.colocated.shm import SharedMemoryExporter

    return SharedMemoryExporter(cfg.shm_dir, cpu_device_id(cfg, rank), prefix=f"colocate-{cfg.job}")


def importer_for(
    cfg: ColocateConfig, *, rank: int = 0, device: torch.device | int | None = None
) -> BucketImporter:
    _colocated_only(cfg)
    if cfg.transport == "CudaIPC":
        from colocate_runtime.colocated.ipc import CudaIpcImporter

        return CudaIpcImporter(device)
    from colocate_runtime.colocated.shm import SharedMemoryImporter

    return SharedMemoryImporter(cfg.shm_dir, cpu_device_id(cfg, rank), prefix=f"colocate-{cfg.job}")


def new_writer(
    cfg: ColocateConfig,
    *,
    rank: int = 0,
    device: torch.device | int | None = None,
    store: MetaStore | None = None,
) -> WeightWriter:
    """A started writer: a new trainer incarnation, heartbeating, its IPC preflight passed (unless Off).
    Raises PreflightFailed as `WeightWriter.start` does, after closing the writer."""
    writer = WeightWriter(
        store or connect(cfg),
        exporter_for(cfg, rank=rank, device=device),
        WriterSettings.from_config(cfg, rank=rank),
    )
    try:
        writer.start()
    except BaseException:
        writer.close()
        raise
    return writer


def new_responder(
    cfg: ColocateConfig,
    *,
    rank: int = 0,
    device: torch.device | int | None = None,
    store: MetaStore | None = None,
) -> PreflightResponder:
    """A started IPC preflight responder for the SGLang side (its own thread; `stop()` ends it)."""
    _colocated_only(cfg)
    visible = None
    if cfg.transport == "CudaIPC":
        from colocate_runtime.colocated.ipc import visible_uuids

        visible = visible_uuids()
    return PreflightResponder(
        store or connect(cfg),
        importer_for(cfg, rank=rank, device=device),
        PreflightSettings.from_config(cfg),
        replica=cfg.replica_index,
        rank=rank,
        visible=visible,
    ).start()


def new_reader(
    cfg: ColocateConfig,
    targets: Mapping[str, torch.Tensor],
    *,
    rank: int = 0,
    device: torch.device | int | None = None,
    target_shards: Mapping[str, TensorShard] | None = None,
    exchange: Exchange | None = None,
    store: MetaStore | None = None,
    preflight: bool = True,
    finalize: Callable[[], None] | None = None,
    scales: Mapping[str, torch.Tensor] | None = None,
    fp8_format: BlockFp8 = FP32_SCALES,
) -> WeightReader:
    """A started reader over `targets` (name -> parameter), heartbeating, and (unless the preflight is Off or
    `preflight=False`: another responder serves this GPU) answering the trainer's IPC preflight. `scales`:
    the scale tensor of each target held in block FP8, quantized into while copied (WeightReader)."""
    reader = WeightReader(
        store or connect(cfg),
        importer_for(cfg, rank=rank, device=device),
        targets,
        ReaderSettings.from_config(cfg, rank=rank),
        target_shards=target_shards,
        exchange=exchange,
        finalize=finalize,
        scales=scales,
        fp8_format=fp8_format,
    ).start()
    if preflight and cfg.ipc_preflight != "Off":
        reader.preflight = new_responder(cfg, rank=rank, device=device, store=reader.store)
    return reader


def reshard_exchange(
    cfg: ColocateConfig,
    trainer: Layout,
    inference: Layout,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    config: ExecutorConfig | None = None,
) -> ReshardExchange:
    """Collective over `group` (the inference engine's ranks, one per GPU): the cross-GPU exchange for a
    reader whose targets (`inference`) differ from the trainer shards published on its GPU (`trainer`).
    Pass it to `new_reader(..., rank=ex.rank, target_shards=ex.target_shards(), exchange=ex)`."""
    from colocate_runtime.colocated.exchange import ReshardExchange

    return ReshardExchange.create(
        trainer,
        inference,
        group=group,
        device=device,
        config=config,
        agree_timeout_s=cfg.step_timeout_s + AGREE_MARGIN_S,
    )
