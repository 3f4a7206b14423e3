"""Mappings a reader keeps from one step to the next, where the producer allows it (`Manifest.kept`): the
trainer's own parameter storage, published in place every step from the same allocation (inplace.py).

Opening a CUDA IPC handle maps the whole allocation (0.5-0.8 ms for 8 GB on an H200) and the close unmaps it
again (most of the close's 0.3-0.4 ms). The reader opens a kept bucket once, as its anchor, and reads every
later step's bucket of the same allocation through that anchor: the step opens and closes nothing of it.

Shares (torch's CUDA IPC reference counting): the step that opens an anchor hands that step's share to it,
and its ACK lists the bucket as opened, so the trainer leaves that share alone; the anchor gives it back when
it is dropped. A later step read through the anchor opens nothing, so its ACK does not list the bucket and
the trainer takes back that step's share itself (`BucketExporter.release`) or publishes that export again.

An anchor is dropped when a manifest no longer keeps its handle (the trainer's storage moved, or it stopped
asking), when the trainer's generation changes, and when the reader closes. Until then the trainer's
allocation stays mapped here: a trainer that frees or offloads its parameters between steps must not
publish with `keep_mapped` (writer.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


def _anchor_key(bucket: BucketRecord) -> tuple[bytes, tuple[object, ...]] | None:
    """An anchor serves a later bucket of the same allocation at the same place in it (one allocation of
    the caching allocator can hold several storages: one handle, several offsets)."""
    key = kept_key(bucket)
    if key is None:
        return None
    d = bucket.descriptor
    return key, (bucket.nbytes, d.get("storage_offset"), d.get("storage_nbytes"), d.get("nbytes"))


@dataclass(frozen=True)
class Held:
    """What `KeptMappings.hold` did for one step."""

    tensors: dict[int, torch.Tensor]  # bucket index -> its anchor: the step copies from these
    opened: tuple[int, ...]  # buckets whose anchor this step opened: their share is the anchor's now

    @property
    def indices(self) -> tuple[int, ...]:
        """The step's buckets now mapped through anchors (its ACK's `kept`)."""
        return tuple(self.tensors)


@dataclass
class _Anchor:
    flat: torch.Tensor
    ref: StorageWeakRef


class KeptMappings:
    """The reader's anchors, one per kept allocation."""

    def __init__(self, importer: BucketImporter) -> None:
        self.importer = importer
        self._anchors: dict[tuple[bytes, tuple[object, ...]], _Anchor] = {}

    def __len__(self) -> int:
        return len(self._anchors)

    def hold(self, buckets: list[BucketRecord]) -> Held:
        """Keep exactly these buckets mapped: anchors of other allocations, or of other places in theirs, are
        dropped first, then a missing one is opened. Call before the step opens the rest."""
        keys = {b.index: _anchor_key(b) for b in buckets}
        for key in [k for k in self._anchors if k not in keys.values()]:
            self._drop(key)
        tensors: dict[int, torch.Tensor] = {}
        opened: list[int] = []
        try:
            for b in buckets:
                key = keys[b.index]
                if key is None:
                    continue
                anchor = self._anchors.get(key)
                if anchor is None:
                    anchor = self._anchors[key] = self._open(b)
                    opened.append(b.index)
                tensors[b.index] = anchor.flat
        except BaseException:
            # The step fails before it reads anything: the anchors it opened close again (their shares go
            # back now), so that its ACK need not name them.
            tensors.clear()
            anchor = None  # this frame stays in the traceback: it must not keep the last anchor alive
            for index in opened:
                key = keys[index]
                assert key is not None
                self._drop(key)
            raise
        return Held(tensors, tuple(opened))

    def _open(self, bucket: BucketRecord) -> _Anchor:
        flat = self.importer.open(bucket.descriptor, bucket.nbytes)
        log.info("kept mapping: bucket %d (%d bytes) stays mapped across steps", bucket.index, bucket.nbytes)
        return _Anchor(flat, StorageWeakRef(flat.untyped_storage()))

    def drop_all(self, why: str) -> None:
        if self._anchors:
            log.info("kept mappings dropped (%d): %s", len(self._anchors), why)
        for key in list(self._anchors):
            self._drop(key)

    def _drop(self, key: tuple[bytes, tuple[object, ...]]) -> None:
        anchor = self._anchors.pop(key)
        self.importer.synchronize()  # no copy still reads through it
        ref = anchor.ref
        del anchor
        if not ref.expired():  # nothing else takes views of an anchor: a leak here is a bug, say so
            log.warning("a kept mapping is still referenced after it was dropped; it closes when that goes")
