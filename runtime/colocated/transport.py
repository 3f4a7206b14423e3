"""How bucket memory crosses from the trainer process to the reader process: the exporter/importer seam.

Two implementations: CUDA IPC (ipc.py, production: the trainer's device memory is mapped by the SGLang
process on the same GPU) and shared memory (shm.py, the CPU path: files in /dev/shm mapped by both
processes). The writer and reader only see these protocols, so the protocol tests on CPU exercise the same
writer/reader code as the GPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from colocate_runtime.colocated.manifest import Descriptor


class TransportError(RuntimeError):
    """Memory that cannot be exported or a descriptor that cannot be opened (the message says why)."""


class DeviceNotVisible(TransportError):
    """The descriptor names a GPU (by UUID) that this process cannot see: the containers differ in GPUs."""


class BucketGone(TransportError):
    """The bucket's shared-memory file is not there for this process (freed, or a different /dev/shm)."""


@dataclass(slots=True)
class LocalBucket:
    """The producer's own bucket: a flat uint8 tensor and, once exported, its descriptor."""

    index: int
    tensor: torch.Tensor | None
    descriptor: Descriptor | None = None


class BucketExporter(Protocol):
    kind: str

    def device_uuid(self) -> str: ...

    def allocate(self, index: int, nbytes: int, tag: str) -> LocalBucket:
        """A new flat uint8 bucket of `nbytes` (not yet exported)."""
        ...

    def export(self, bucket: LocalBucket) -> None:
        """Fill `bucket.descriptor` after the bucket was packed (work enqueued on the current stream)."""
        ...

    def synchronize(self) -> None: ...

    def release(self, buckets: list[LocalBucket]) -> None:
        """Give up the importer's share of exported buckets that no importer maps or ever will (never opened,
        or the importer is gone), so `free` returns their memory now (CUDA IPC: torch's share count)."""
        ...

    def free(self, buckets: list[LocalBucket]) -> None:
        """Return the memory: only after an ACK with ipc_closed, or once the importer is known dead."""
        ...


class BucketImporter(Protocol):
    kind: str

    def device_uuid(self) -> str: ...

    def open(self, descriptor: Descriptor, nbytes: int) -> torch.Tensor:
        """Map a bucket: a flat uint8 tensor of `nbytes` aliasing the producer's memory."""
        ...

    def synchronize(self) -> None: ...
