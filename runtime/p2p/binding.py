"""A rank's schedule resolved against its own shards, and its local tensors checked against them.

Everything that can be known from metadata is computed once when an exchange is created: for every message,
its slices in local shard coordinates and whether it could move in place (one slice, dense within its shard,
no cast when sending). A run then only checks each local tensor once (shape, dtype, device, contiguity); the
`program` module turns the result into buffers and copies once per layout of the local tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.p2p.chunks import Message, PeerBatch, RankSchedule, is_dense_in
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.shards import Box, ShardError

SOURCE, TARGET = "source", "target"


@dataclass(frozen=True, slots=True)
class WirePiece:
    """One slice of a message on this rank: which local tensor, which box of it, where in the message."""

    name: str
    box: Box
    offset: int
    dtype: torch.dtype  # on the wire: the receiver's dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wire:
    """One message as this rank posts it."""

    nbytes: int
    pieces: tuple[WirePiece, ...]
    movable: bool  # one dense slice needing no cast: sent from / received into the tensor itself


@dataclass(frozen=True, slots=True)
class BatchWork:
    batch: PeerBatch
    sends: tuple[Wire, ...]
    recvs: tuple[Wire, ...]


def resolve(schedule: RankSchedule, senders: Layout, receivers: Layout) -> tuple[tuple[BatchWork, ...], ...]:
    """Per chunk, this rank's batches with every slice in local shard coordinates."""
    send_shapes = _local_shapes(senders, schedule.rank)
    recv_shapes = _local_shapes(receivers, schedule.rank)

    def wire(message: Message, sending: bool) -> Wire:
        pieces = []
        for s in message.slices:
            t = s.transfer
            box = t.src_box if sending else t.dst_box
            pieces.append(WirePiece(t.name, box, s.offset, torch_dtype(t.dst_dtype), t.region.lengths))
        only = message.slices[0].transfer
        shape = (send_shapes if sending else recv_shapes)[only.name]
        movable = (
            len(pieces) == 1
            and is_dense_in(pieces[0].box, shape)
            and not (sending and only.src_dtype != only.dst_dtype)
        )
        return Wire(message.nbytes, tuple(pieces), movable)

    return tuple(
        tuple(
            BatchWork(b, tuple(wire(m, True) for m in b.sends), tuple(wire(m, False) for m in b.recvs))
            for b in chunk.batches
        )
        for chunk in schedule.chunks
    )


def _local_shapes(layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for p in layout.params:
        box = p.box_of(rank)
        if box is not None:
            out[p.name] = box.lengths
    return out


# What a run checks for one local tensor: name, shard shape, dtype, and whether its density matters (it is
# the tensor of a movable message).
Spec = tuple[str, tuple[int, ...], torch.dtype, bool]


class LocalTensors:
    """This rank's sources and targets for one run, each checked once against its shard.

    `signature` is what a run program depends on besides the plan, found in the same pass: which tensors of
    movable messages are dense, in the order of the specs."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        specs: Mapping[str, tuple[Spec, ...]],
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
    ) -> None:
        self._tensors: dict[str, dict[str, torch.Tensor]] = {SOURCE: {}, TARGET: {}}
        self._dense: dict[str, dict[str, bool]] = {SOURCE: {}, TARGET: {}}
        signature: list[bool] = []
        for kind in (SOURCE, TARGET):
            given, out, dense = tensors[kind], self._tensors[kind], self._dense[kind]
            for name, shape, dtype, movable in specs[kind]:
                tensor = given.get(name)
                # One cheap test per tensor (this loop runs before any byte moves); details on failure.
                if (
                    tensor is None
                    or tensor.shape != shape
                    or tensor.dtype != dtype
                    or tensor.device != device
                ):
                    _reject(rank, device, kind, name, shape, dtype, tensor)
                out[name] = tensor
                if movable:
                    dense[name] = tensor.is_contiguous()
                    signature.append(dense[name])
        self.signature = tuple(signature)

    def in_place(self, kind: str, wire: Wire) -> bool:
        return wire.movable and self._dense[kind][wire.pieces[0].name]

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return self._tensors[kind]


def _reject(
    rank: int,
    device: torch.device,
    kind: str,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    tensor: torch.Tensor | None,
) -> None:
    if tensor is None:
        raise ShardError(f"{name}: rank {rank} has no local {kind} tensor for it")
    what = f"{name}: the local {kind} on rank {rank}"
    if tuple(tensor.shape) != shape:
        raise ShardError(f"{what} has shape {tuple(tensor.shape)}, its shard is {list(shape)}")
    if tensor.dtype != dtype:
        raise ShardError(f"{what} is {tensor.dtype}, expected {dtype}")
    raise ShardError(f"{what} is on {tensor.device}, the exchange on {device}")
