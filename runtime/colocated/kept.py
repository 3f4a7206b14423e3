"""Mappings a reader keeps from one step to the next, where the producer allows it (`Manifest.kept`): the
trainer's own parameter storage, published in place every step from the same allocation (inplace.py).

Opening a CUDA IPC handle maps the whole allocation (0.5-0.8 ms for 8 GB on an H200) and the close unmaps it
again (most of the close's 0.3-0.4 ms). torch maps a handle once per process while any storage opened from
it lives (the caching allocator's `getIpcDevPtr` cache), so one extra storage per kept handle, the anchor,
lets every later step's open reuse the mapping. Each step still opens its own storage, and the step's
verified close still drops it and checks it is gone (its share of that step's alias returns to zero); only
the anchor holds one share of the alias it was opened from, which keeps that alias in the trainer's IPC
limbo (it points at the parameters the trainer holds anyway).

An anchor is dropped when a manifest no longer keeps its handle (the trainer's storage moved, or it stopped
asking), when the trainer's generation changes, and when the reader closes. Until then the trainer's
allocation stays mapped here: a trainer that frees or offloads its parameters between steps must not
publish with `keep_mapped` (writer.py).
"""

from __future__ import annotations

import logging

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from colocate_runtime.colocated.manifest import BucketRecord
from colocate_runtime.colocated.transport import BucketImporter

log = logging.getLogger(__name__)


def kept_key(bucket: BucketRecord) -> bytes | None:
    """What a kept mapping is known by: the device and what names the allocation there (a CUDA IPC handle,
    torch's own cache key; a shared-memory file). None for a descriptor without either."""
    d = bucket.descriptor
    uuid, name = d.get("uuid"), d.get("handle", d.get("file"))
    if not isinstance(uuid, str) or not isinstance(name, bytes | str) or not name:
        return None
    return uuid.encode() + b"/" + (name if isinstance(name, bytes) else name.encode())


class KeptMappings:
    """The reader's anchors, one per kept allocation."""

    def __init__(self, importer: BucketImporter) -> None:
        self.importer = importer
        self._anchors: dict[bytes, tuple[torch.Tensor, StorageWeakRef]] = {}

    def __len__(self) -> int:
        return len(self._anchors)

    def hold(self, buckets: list[BucketRecord]) -> tuple[int, ...]:
        """Keep exactly these buckets' allocations mapped: anchors of other allocations are dropped first,
        then a missing one is opened. Returns the bucket indices now held. Call before the step opens them."""
        keys = {b.index: kept_key(b) for b in buckets}
        wanted = {k for k in keys.values() if k is not None}
        for key in [k for k in self._anchors if k not in wanted]:
            self._drop(key)
        for b in buckets:
            key = keys[b.index]
            if key is not None and key not in self._anchors:
                flat = self.importer.open(b.descriptor, b.nbytes)
                self._anchors[key] = (flat, StorageWeakRef(flat.untyped_storage()))
                log.info("kept mapping: bucket %d (%d bytes) stays mapped across steps", b.index, b.nbytes)
        return tuple(i for i, k in keys.items() if k is not None)

    def drop_all(self, why: str) -> None:
        if self._anchors:
            log.info("kept mappings dropped (%d): %s", len(self._anchors), why)
        for key in list(self._anchors):
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        flat, ref = self._anchors.pop(key)
        self.importer.synchronize()  # no copy still reads through it
        del flat
        if not ref.expired():  # nothing else takes views of an anchor: a leak here is a bug, say so
            log.warning("a kept mapping is still referenced after it was dropped; it closes when that goes")
