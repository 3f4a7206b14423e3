"""A rank's run program: its chunks of messages resolved to buffers once, then replayed by every run.

What a run does depends only on the plan and on which local tensors are dense, so it is worked out once per
exchange and layout of the local tensors: which messages move in place and which travel through staging,
every staging window and typed view of it, and which pieces are whole tensors. A run then only looks the
caller's tensors up by name, cuts the few views that are not whole tensors, and launches copies and messages.

In place: a message of one piece whose region is one dense run of a contiguous local tensor (whole trailing
dimensions, e.g. a row range of a row-major parameter) and needs no cast is posted on a view of that tensor,
so a receive lands straight in the target (no staging bytes, no unpack copy) and a send leaves from the
source. Everything else goes through staging: several slices packed into one message (those below
`direct_min_bytes`), strided regions, and casts (the sender casts, so a receiver's wire dtype is always its
own). `in_place` and `staged` count each side's payload bytes both ways, for the run's report.

The program holds no caller tensor: sources and targets may be freed or remapped between runs (CUDA IPC
buffers are closed after every step), so views of them are made per run. It keeps only views of its own
staging arena, whose memory is released between runs (the storage shrinks to nothing, views stay valid).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from colocate_runtime.bits import foreach_copy_bits
from colocate_runtime.p2p.binding import SOURCE, TARGET, BatchWork, LocalTensors, Wire, WirePiece
from colocate_runtime.p2p.chunks import aligned
from colocate_runtime.p2p.plan import Transfer
from colocate_runtime.p2p.staging import box_view, typed_view
from colocate_runtime.shards import Box


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a staged message: its typed window of staging and the local tensor region behind it."""

    staging: torch.Tensor
    name: str
    box: Box | None  # None: the whole local tensor


@dataclass(frozen=True, slots=True)
class Msg:
    """One message as this rank posts it: straight from / into a local tensor, or through staging."""

    nbytes: int
    name: str | None = None  # in place: the local tensor
    span: tuple[int, int] | None = None  # in place: (first element, count) of the flattened tensor; None: all
    staging: torch.Tensor | None = None  # staged: the uint8 window of the arena
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One peer batch of one chunk."""

    work: BatchWork
    sends: tuple[Msg, ...]
    recvs: tuple[Msg, ...]
    copies: int  # pack copies before it and unpack copies after it


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """A plan transfer whose sender and receiver are this rank."""

    src: str
    src_box: Box | None  # None: the whole tensor
    dst: str
    dst_box: Box | None


class Arena:
    """Byte slots for staged messages in one allocation, held only while a run needs it."""

    def __init__(self, slot_bytes: list[int], device: torch.device) -> None:
        sizes = [aligned(b) for b in slot_bytes]
        self.nbytes = sum(sizes)
        self._storage = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.slots: list[torch.Tensor] = []
        start = 0
        for size in sizes:
            self.slots.append(self._storage[start : start + size])
            start += size

    def acquire(self) -> None:
        """Back the slots (and every view of them) with fresh memory."""
        self._storage.untyped_storage().resize_(self.nbytes)

    def release(self) -> None:
        """Give the memory back to the allocator; views keep their shape and offsets for the next run."""
        self._storage.untyped_storage().resize_(0)


class Program:
    """Every chunk of one rank's schedule, resolved for one layout of its local tensors."""

    def __init__(
        self,
        work: tuple[tuple[BatchWork, ...], ...],
        local: LocalTensors,
        shapes: Mapping[str, Mapping[str, tuple[int, ...]]],
        depth: int,
        budget: int,
        device: torch.device,
    ) -> None:
        staged = [_staged_bytes(chunk, local) for chunk in work]
        depth = max(1, min(depth, len(work)))
        # The staging of `depth` chunks in flight must fit the budget. It does by construction for chunks of
        # budget / depth; whole-budget chunks were chosen for dense tensors, so non-contiguous ones may need
        # a shallower pipeline. One slot always fits: a chunk stages at most its budgeted bytes.
        while depth > 1 and sum(aligned(max(staged[s::depth])) for s in range(depth)) > budget:
            depth -= 1
        self.depth = depth
        self.arena = Arena([max(staged[s::depth], default=0) for s in range(depth)], device)
        self.chunks: list[tuple[Step, ...]] = []
        # Payload bytes per side, by whether their message moves in place or through staging: decided here,
        # once per layout of the local tensors, and reported by every run.
        self.in_place = {SOURCE: 0, TARGET: 0}
        self.staged = {SOURCE: 0, TARGET: 0}
        for index, chunk in enumerate(work):
            slot = self.arena.slots[index % depth]
            offset = 0
            steps = []
            for b in chunk:
                sends, recvs = [], []
                copies = 0
                for kind, wires, out in ((SOURCE, b.sends, sends), (TARGET, b.recvs, recvs)):
                    for wire in wires:
                        if local.in_place(kind, wire):
                            out.append(_in_place(wire, shapes[kind]))
                            self.in_place[kind] += _payload(wire)
                            continue
                        self.staged[kind] += _payload(wire)
                        window = slot[offset : offset + wire.nbytes]
                        offset += aligned(wire.nbytes)
                        parts = tuple(_part(window, piece, shapes[kind]) for piece in wire.pieces)
                        copies += len(parts)
                        out.append(Msg(wire.nbytes, staging=window, parts=parts))
                steps.append(Step(b, tuple(sends), tuple(recvs), copies))
            self.chunks.append(tuple(steps))
        self.arena.release()  # views of the slots are cut; memory only while a run needs it


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each source into its destination. Dense tensors go through torch's multi-tensor kernel: a few
    launches instead of one per slice (packing 65 norms took the host 31 us instead of about 360, and the
    first chunk cannot start before its packing is launched). Through integer views: bits survive."""
    foreach_copy_bits(dsts, srcs)


def buffer(msg: Msg, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The memory a message is sent from or received into, in this run's tensors."""
    if msg.staging is not None:
        return msg.staging
    assert msg.name is not None
    tensor = tensors[msg.name]
    if msg.span is None:
        return tensor  # NCCL and gloo match messages by bytes, so the dtype needs no byte view
    first, count = msg.span
    return tensor.view(-1)[first : first + count]


def region(tensors: Mapping[str, torch.Tensor], name: str, box: Box | None) -> torch.Tensor:
    tensor = tensors[name]
    return tensor if box is None else box_view(tensor, box)


def local_copies(
    transfers: tuple[Transfer, ...],
    senders: Mapping[str, tuple[int, ...]],
    receivers: Mapping[str, tuple[int, ...]],
) -> tuple[LocalCopy, ...]:
    return tuple(
        LocalCopy(
            t.name,
            _box_or_whole(t.src_box, senders[t.name]),
            t.name,
            _box_or_whole(t.dst_box, receivers[t.name]),
        )
        for t in transfers
    )


def _staged_bytes(chunk: tuple[BatchWork, ...], local: LocalTensors) -> int:
    """Staging bytes one chunk needs on this rank: every message that cannot move in place."""
    total = 0
    for b in chunk:
        total += sum(aligned(w.nbytes) for w in b.sends if not local.in_place(SOURCE, w))
        total += sum(aligned(w.nbytes) for w in b.recvs if not local.in_place(TARGET, w))
    return total


def _payload(wire: Wire) -> int:
    """A message's bytes without the alignment padding between its pieces."""
    return sum(p.box.numel * p.dtype.itemsize for p in wire.pieces)


def _box_or_whole(box: Box, shape: tuple[int, ...]) -> Box | None:
    return None if box.lengths == tuple(shape) else box


def _in_place(wire: Wire, shapes: Mapping[str, tuple[int, ...]]) -> Msg:
    piece = wire.pieces[0]
    shape = shapes[piece.name]
    if piece.box.lengths == tuple(shape):
        return Msg(wire.nbytes, name=piece.name)
    # A box that is dense in a row-major tensor is one run of its flattened elements.
    first, stride = 0, 1
    for offset, length in zip(reversed(piece.box.offsets), reversed(shape), strict=True):
        first += offset * stride
        stride *= length
    return Msg(wire.nbytes, name=piece.name, span=(first, piece.box.numel))


def _part(window: torch.Tensor, piece: WirePiece, shapes: Mapping[str, tuple[int, ...]]) -> Part:
    view = typed_view(window, piece.offset, piece.dtype, piece.shape)
    return Part(view, piece.name, _box_or_whole(piece.box, shapes[piece.name]))
