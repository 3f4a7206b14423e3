"""Build a process's writer or reader from its `ColocateConfig` (the one place that picks a transport)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from colocate_runtime.colocated.config import ColocateConfig, ConfigError
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.liveness import host_id
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.colocated.reader import Exchange, ReaderSettings, WeightReader
from colocate_runtime.colocated.transport import BucketExporter, BucketImporter
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.shards import TensorShard


def connect(cfg: ColocateConfig) -> MetaStore:
    return MetaStore.connect(cfg.metastore, KeySchema(cfg.namespace, cfg.job), key_ttl_s=cfg.key_ttl_s)


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
    """A started writer: a new trainer incarnation, heartbeating."""
    writer = WeightWriter(
        store or connect(cfg),
        exporter_for(cfg, rank=rank, device=device),
        WriterSettings.from_config(cfg, rank=rank),
    )
    writer.start()
    return writer


def new_reader(
    cfg: ColocateConfig,
    targets: Mapping[str, torch.Tensor],
    *,
    rank: int = 0,
    device: torch.device | int | None = None,
    target_shards: Mapping[str, TensorShard] | None = None,
    exchange: Exchange | None = None,
    store: MetaStore | None = None,
) -> WeightReader:
    """A started reader over `targets` (name -> parameter), heartbeating."""
    return WeightReader(
        store or connect(cfg),
        importer_for(cfg, rank=rank, device=device),
        targets,
        ReaderSettings.from_config(cfg, rank=rank),
        target_shards=target_shards,
        exchange=exchange,
    ).start()
