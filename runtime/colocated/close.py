"""The forced IPC close: the reader's mappings of one step, held in one place and released verifiably.

A CUDA IPC mapping is closed (`cudaIpcCloseMemHandle`) by the storage deleter, i.e. only when the last view of
the storage dies. If that happens late (a view kept in a cycle, an exception traceback holding a frame), the
trainer may already have freed and reallocated the memory, and the stale mapping then corrupts fresh
allocations at drifting places. So the reader keeps every mapping in an `ImportScope` and, before its ACK:
synchronizes the device (no copy still reads the mapping), drops the scope's references, checks through weak
references to the storages that each one is really gone, and only if one is still alive runs `gc.collect()`
(35-75 ms in a serving process, against well under a millisecond for the check) and checks again.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class CloseError(RuntimeError):
    """A mapping is still referenced after the fallback collection: the ACK must say ipc_closed=false."""


@dataclass(frozen=True, slots=True)
class CloseReport:
    released: bool
    gc_fallback: bool
    alive: tuple[int, ...]  # bucket indices still mapped
    seconds: float
    gc_seconds: float = 0.0
    opened: tuple[int, ...] = ()  # every bucket index mapped in this scope (the ACK says so to the trainer)


class ImportScope:
    """Owns the mapped buckets of one step. Views may be taken freely but must not outlive `close()`."""

    def __init__(self) -> None:
        self._tensors: dict[int, torch.Tensor] = {}
        self._refs: dict[int, StorageWeakRef] = {}
        self._opened: list[int] = []

    def add(self, index: int, flat: torch.Tensor) -> None:
        if index in self._tensors or index in self._refs:
            raise ValueError(f"bucket {index} is opened twice")
        self._tensors[index] = flat
        self._refs[index] = StorageWeakRef(flat.untyped_storage())
        self._opened.append(index)

    def borrow(self, index: int, flat: torch.Tensor, *, opened: bool) -> None:
        """A bucket read through a mapping that outlives the step (a kept anchor, kept.py): its tensor is
        dropped at the close but never checked gone. `opened`: the anchor was opened for this step, which
        the ACK must say (that share is the anchor's, not the trainer's to release)."""
        if index in self._tensors or index in self._refs:
            raise ValueError(f"bucket {index} is opened twice")
        self._tensors[index] = flat
        if opened:
            self._opened.append(index)

    def bucket(self, index: int) -> torch.Tensor:
        return self._tensors[index]

    def __len__(self) -> int:
        return len(self._refs)

    def alive(self) -> tuple[int, ...]:
        return tuple(i for i, ref in self._refs.items() if not ref.expired())

    def close(self, synchronize: Callable[[], None], *, blanket_gc: bool = False) -> CloseReport:
        """Release every mapping and verify it. `blanket_gc` always collects (the bench's baseline)."""
        t0 = time.perf_counter()
        synchronize()
        self._tensors.clear()
        gc_seconds = 0.0
        used_gc = False
        alive = self.alive()
        if alive or blanket_gc:
            g0 = time.perf_counter()
            gc.collect()
            gc_seconds = time.perf_counter() - g0
            used_gc = True
            alive = self.alive()
        synchronize()
        if not alive:
            self._refs.clear()
        return CloseReport(
            not alive, used_gc, alive, time.perf_counter() - t0, gc_seconds, tuple(self._opened)
        )
