"""Trainer side of the one-pass update: publish the trainer's own parameter storage, pack only the rest.

Megatron-core keeps a rank's parameters as views into a few contiguous per-dtype buffers (its DDP
`param_data`). Packing them into buckets is a full copy of the rank's weights every step; exporting those
buffers' storage instead costs one CUDA IPC handle each, and the reader copies straight from them into its
own fused parameters (gather.py). Each entry is a strided view of its storage (Megatron's interleaved q/k/v
groups are one), described once per layout.

Pieces that cannot be read in place are packed into buckets as before: a dtype cast, a layout only a copy
produces, storage the transport cannot export (shared memory on CPU) and storages holding too few bytes to be
worth a handle of their own (a plain parameter per allocation: thousands of handles cost more than a copy).

Each step exports a fresh alias of each adopted storage (a DLPack view: its own storage object), so torch's
IPC reference counting wraps the alias, never the trainer's parameter, and nothing accumulates on the
parameter from step to step. With kept mappings (kept.py) an alias whose step's reader read it through its
anchor, opening nothing, is published again by the next step as it is (`standing`), export and all.

The trainer must not write those parameters until the step's ACK: the optimizer step comes after
`wait_and_free` returns (the protocol already holds the trainer there). A step that failed while its reader
may still be copying (a timeout, parked) can see the trainer's next writes: such a step is never installed
(SGLang keeps its weight version and stays paused; see sglang/rollout.py) and the next step rewrites every
byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from colocate_runtime.bits import copy_bits
from colocate_runtime.colocated.buckets import BucketSpec, EntrySpec, PlacedEntry, plan_buckets
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.colocated.views import dtype_name, entry_view
from colocate_runtime.shards import TensorShard

# A storage is exported in place only when it carries at least this much of the step: below, a handle
# (about a millisecond to open) costs more than copying its bytes into a shared bucket.
MIN_ADOPT_BYTES = 256 << 20
MAX_ADOPTED = 16  # handles per step; Megatron has one or two buffers per dtype and expert group


class LayoutMoved(ValueError):
    """The trainer's parameters are no longer where the in-place layout reads them."""


class SourcePiece(Protocol):
    """One canonical piece of the rank (convert's `BoundPiece`)."""

    @property
    def shard(self) -> TensorShard: ...

    def data(self) -> torch.Tensor: ...

    def view(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class InPlaceLayout:
    """A rank's step layout, compiled once: which storages are exported as they are, what is packed."""

    adopted: tuple[torch.Tensor, ...]  # uint8 over each adopted storage, bucket i = adopted[i]
    specs: tuple[BucketSpec, ...]  # every bucket: the adopted storages, then the packed buckets
    entries: tuple[PlacedEntry, ...]
    packed: tuple[tuple[PlacedEntry, SourcePiece], ...]  # entries whose data is copied every step
    sources: dict[str, SourcePiece]
    # Per adopted storage, the first and last piece read from it and where their data began at compile time:
    # a parameter moved since (offload and reload, a new DDP buffer) must not publish the old storage.
    anchors: tuple[tuple[SourcePiece, int], ...] = ()

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def packed_bytes(self) -> int:
        return sum(e.nbytes for e, _ in self.packed)

    def data(self, name: str) -> torch.Tensor:
        """An entry's data (for sampled checksums)."""
        return self.sources[name].data()

    def stage(
        self, exporter: BucketExporter, tag: str, standing: Mapping[int, LocalBucket] | None = None
    ) -> list[LocalBucket]:
        """This step's buckets: an alias of each adopted storage (`standing`'s, already exported, where it
        has one; else a fresh one), then the packed ones, filled."""
        for piece, ptr in self.anchors:
            view = piece.view()
            if view is None or view.data_ptr() != ptr:
                raise LayoutMoved(
                    f"{piece.shard.name} no longer lies where the in-place layout was compiled (the "
                    "trainer's parameters moved, e.g. offloaded and reloaded): compile it again "
                    "(in_place_layout)"
                )
        # A capsule, not the tensor: `from_dlpack(tensor)` orders a stream handoff (an event each, about
        # 30 us on an H200) that one process on one stream does not need; the export's synchronize follows.
        reuse = standing or {}
        buckets = [reuse.get(i) or _alias(i, base) for i, base in enumerate(self.adopted)]
        first = len(self.adopted)
        buckets += [exporter.allocate(s.index, s.nbytes, tag) for s in self.specs[first:]]
        try:
            with torch.no_grad():
                for e, source in self.packed:
                    flat = buckets[e.bucket].tensor
                    assert flat is not None
                    copy_bits(entry_view(flat, e), source.data())
        except BaseException:
            exporter.free(buckets[first:])
            raise
        return buckets

    @staticmethod
    def compile(
        pieces: Sequence[SourcePiece],
        *,
        adoptable: Callable[[torch.Tensor], bool],
        bucket_bytes: int,
        min_adopt_bytes: int = MIN_ADOPT_BYTES,
        max_adopted: int = MAX_ADOPTED,
    ) -> InPlaceLayout:
        """`adoptable`: whether the transport can export a tensor's storage as it is (`adoptable_by`)."""
        views: dict[tuple[int, str], list[tuple[SourcePiece, torch.Tensor]]] = {}
        rest: list[SourcePiece] = []
        for piece in pieces:
            view = piece.view()
            if view is None or not adoptable(view):
                rest.append(piece)
                continue
            views.setdefault((view.untyped_storage().data_ptr(), dtype_name(view.dtype)), []).append(
                (piece, view)
            )
        ranked = sorted(views.values(), key=lambda group: -sum(v.nbytes for _, v in group))
        chosen = [g for g in ranked if sum(v.nbytes for _, v in g) >= min_adopt_bytes][:max_adopted]
        taken = {id(p) for g in chosen for p, _ in g}
        rest += [p for g in ranked for p, _ in g if id(p) not in taken]

        adopted, specs, entries = [], [], []
        anchors = [(p, v.data_ptr()) for g in chosen for p, v in (g[0], g[-1])]
        for index, group in enumerate(chosen):
            storage = group[0][1].untyped_storage()
            base = torch.empty(0, dtype=torch.uint8, device=group[0][1].device).set_(storage)
            adopted.append(base)
            dtype = dtype_name(group[0][1].dtype)
            specs.append(BucketSpec(index, dtype, storage.nbytes()))
            for piece, view in group:
                entries.append(_view_entry(piece.shard, view, index, storage.data_ptr()))
        packed_plan = plan_buckets(
            [EntrySpec(p.shard.name, p.shard.dtype, p.shard.box.lengths, p.shard) for p in rest],
            bucket_bytes,
        )
        shift = len(adopted)
        by_name = {p.shard.name: p for p in rest}
        packed = []
        for b in packed_plan.buckets if rest else ():
            specs.append(BucketSpec(b.index + shift, b.dtype, b.nbytes))
        for e in packed_plan.entries:
            moved = PlacedEntry(e.name, e.dtype, e.shape, e.bucket + shift, e.offset, e.nbytes, e.shard)
            entries.append(moved)
            packed.append((moved, by_name[e.name]))
        sources = {p.shard.name: p for p in pieces}
        return InPlaceLayout(
            tuple(adopted), tuple(specs), tuple(entries), tuple(packed), sources, tuple(anchors)
        )


def _alias(index: int, base: torch.Tensor) -> LocalBucket:
    return LocalBucket(index, from_dlpack(to_dlpack(base)))


def adoptable_by(exporter: BucketExporter) -> Callable[[torch.Tensor], bool]:
    """CUDA IPC exports any allocation on its GPU; shared memory only its own files (nothing adopted)."""
    device = getattr(exporter, "device", None)
    if exporter.kind != "CudaIPC" or not isinstance(device, torch.device):
        return lambda t: False
    return lambda t: t.device == device


def _view_entry(shard: TensorShard, view: torch.Tensor, bucket: int, base: int) -> PlacedEntry:
    esize = view.element_size()
    offset = view.data_ptr() - base
    nbytes = math.prod(shard.box.lengths) * esize
    if view.numel() * esize != nbytes:
        raise ValueError(f"{shard.name}: in-place view of {view.numel()} elements for a box of {shard.box}")
    view_of = (tuple(view.shape), tuple(view.stride()))
    return PlacedEntry(shard.name, shard.dtype, shard.box.lengths, bucket, offset, nbytes, shard, view_of)
