"""The seam between the reader and a cross-GPU exchange: what the reader hands over, and what it expects back.

Types only (torch is imported for the type checker alone): the reader (reader.py) calls an `Exchange`, and the
reshard over runtime/p2p (exchange.py) is one; each imports this module, not the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.manifest import Manifest
from colocate_runtime.shards import Box, TensorShard

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ExchangeRequest:
    """What the local copy could not do. Views in `local` alias the mapped buckets: valid during the call.

    `missing` maps a target name to its parameter; `missing_boxes` the regions of it (global coordinates, per
    `target_shards`) still to fill. The exchange enqueues its device work on the current stream (the reader
    synchronizes before the close), keeps no reference to any view after it returns, and returns the names it
    filled completely. A receive that needs a dense buffer stages into one and copies back.
    """

    manifest: Manifest
    local: Mapping[str, torch.Tensor]
    local_entries: Mapping[str, PlacedEntry]
    missing: Mapping[str, torch.Tensor]
    missing_boxes: Mapping[str, tuple[Box, ...]]
    target_shards: Mapping[str, TensorShard]


class Exchange(Protocol):
    """Fills what the local copy could not. When set, the reader calls it on every step it applies, even with
    nothing missing: a collective exchange needs every GPU, including those that only send.

    A collective exchange may also define `abandon(error)`: the reader calls it when a step fails on this GPU
    before the exchange was called (no step published in time, a bad manifest, an abort), so peers already
    waiting in the exchange fail at once instead of at their timeout. So every `apply_next` (or `apply`)
    takes part in the exchange exactly once: by calling it, or by abandoning.
    """

    def __call__(self, request: ExchangeRequest) -> set[str]: ...
