"""The weights check of every step: both sides hash the same small sample of every entry, chosen by the step.

What is hashed. Each manifest entry is read as its own logical bytes (its elements in row-major order, raw
bits). The trainer hashes the sampled bytes where it published them (its bucket, or its own storage in
place). The reader hashes the same logical bytes where they were installed: the destination elements of the
part of the entry this rank holds. It finds them from the target and shard boxes itself, not from the copy
program, so a stale, half-written or mis-mapped install is caught as well as a bad transport. Bytes this
rank does not install are hashed from its mapping of the bucket instead, so only their transport is
checked. That covers an entry with no parameter here, a part left to the exchange, and block-FP8 targets,
whose installed bytes are a quantization of the entry.

The sample. Chunks of `CHUNK_BYTES` (32) logical bytes, about one DRAM sector each. An entry of n bytes has
period p = min(P, ceil(n / 32)), where P is the trainer's `COLOCATE_WEIGHT_DIGEST_PERIOD`, and windows of
g = 32 p bytes. Step s reads the chunk at 32 ((s + crc32(name)) mod p) of every window. So each step reads
1/P of every entry, and at least one chunk of every entry. Any P consecutive steps read every byte of every
entry: that is the coverage bound. A corruption spanning g + 32 contiguous bytes of an entry (a whole
parameter, a bucket region) is caught in the step it happens. A single flipped byte is caught within P steps.

The hash. Per entry, the low 16 bits of sum(byte * w(pos)), where w(pos) is an odd 24-bit multiplicative
hash of the byte's logical position. A change of one byte always changes it (an odd w times a change below
2^8 is never a multiple of 2^16), and so do bytes that moved, but for a 2^-16 chance per entry and step
when many bytes change. The manifest carries the trainer's values (2 bytes an entry). The reader compares
and names, in its ACK, the parameters that differ.

Cost. The tables (per chunk: its entry, its window and the few segments the window touches) are built once
per layout. A step is one kernel launch (Triton, loading from absolute addresses, each storage's base given
relative to one base tensor as in fastcopy.py; a second one only for entries whose segments do not start on
chunk boundaries), a cumsum and two gathers. Then one device-to-host read of 8 bytes an entry. Without
Triton, or on CPU, the same arithmetic runs in torch.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from colocate_runtime.colocated import strided
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.views import dtype_name, indexed
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard

log = logging.getLogger(__name__)

CHUNK_BYTES = 32
DIGEST_DTYPE = "<u2"  # per entry on the wire: 2 bytes (18,867 entries of Qwen3-30B-A3B: 37 KB a step)
BLOCK = 32  # chunks per program
_W_MUL = 1540483477  # < 2**31: (pos mod 2**31) * _W_MUL stays inside int64

Bucket = Callable[[int], torch.Tensor]  # a bucket's index -> this step's flat uint8 tensor of it


@dataclass(frozen=True, slots=True)
class Segments:
    """An entry's logical bytes -> storage: from `start[i]` (a logical byte offset, the first 0) up to the
    next start, the bytes lie at `addr[i]` onward in storage `slot[i]`."""

    start: list[int]
    slot: list[int]
    addr: list[int]


@functools.cache
def _kernel_module() -> ModuleType | None:
    try:
        from colocate_runtime.colocated import digest_kernel
    except ImportError as err:  # images without Triton hash in torch
        log.info("digest kernel unavailable (%s); hashing the sample in torch", err)
        return None
    return digest_kernel


def _interpreted() -> bool:
    """Triton runs the kernel on CPU tensors only when interpreted (TRITON_INTERPRET=1 before its import)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or _kernel_module() is None:
        return False
    return bool(sys.modules["triton"].knobs.runtime.interpret)


def source_segments(e: PlacedEntry, slot: int) -> Segments:
    """Where the entry's logical bytes lie in its bucket (a packed range, or an in-place strided view)."""
    if e.view is None:
        return Segments([0], [slot], [e.offset])
    shape, strides = e.view
    addr, length = strided.runs(e.offset, shape, strides, DTYPE_BYTES[e.dtype])
    start = torch.cumsum(length, 0) - length
    return Segments(start.tolist(), [slot] * int(addr.numel()), addr.tolist())


def installed_segments(
    e: PlacedEntry,
    target: torch.Tensor | None,
    tshard: TensorShard | None,
    source: Segments,
    storage: Callable[[torch.Tensor], tuple[int, int]],
) -> Segments:
    """The part of the entry this rank installs into `target`, where it landed (the same boxes the copy
    program cuts: the trainer's box intersected with the parameter's), the rest where `source` says.
    `storage(view)`: the slot of the view's storage and the view's byte offset in it."""
    if target is None or dtype_name(target.dtype) != e.dtype:
        return source
    src_box = e.shard.box if e.shard is not None else Box.full(e.shape)
    dst_box = tshard.box if tshard is not None else Box.full(tuple(target.shape))
    if src_box.ndim != dst_box.ndim:
        return source
    common = src_box.intersect(dst_box)
    if common is None:
        return source
    part = common.relative_to(src_box)
    dst = target[common.relative_to(dst_box).slices()]
    slot, offset = storage(dst)
    if part == Box.full(e.shape) and dst.is_contiguous():
        return Segments([0], [slot], [offset])
    esize = DTYPE_BYTES[e.dtype]
    ranges = strided.box_ranges(e.shape, part.offsets, part.lengths, esize)
    runs = strided.runs(offset, tuple(dst.shape), tuple(dst.stride()), esize)
    lpos, daddr, length = strided.segments(ranges, runs)
    return _overlay(lpos, length, daddr, slot, source, e.nbytes)


def _overlay(
    a_start: torch.Tensor, a_len: torch.Tensor, a_addr: torch.Tensor, a_slot: int, b: Segments, n: int
) -> Segments:
    """Segments of `a` (logical runs in one slot) where it has them, `b`'s elsewhere; adjacent pieces that
    continue each other in one slot merged."""
    b_start = torch.tensor(b.start, dtype=torch.int64)
    b_slot = torch.tensor(b.slot, dtype=torch.int64)
    b_addr = torch.tensor(b.addr, dtype=torch.int64)
    edges = torch.cat([a_start, a_start + a_len, b_start, torch.tensor([0], dtype=torch.int64)])
    cuts = torch.unique(edges)
    cuts = cuts[cuts < n]
    ia = (torch.searchsorted(a_start, cuts, right=True) - 1).clamp(min=0)
    in_a = (cuts >= a_start[ia]) & (cuts < a_start[ia] + a_len[ia]) if a_start.numel() else cuts < 0
    ib = torch.searchsorted(b_start, cuts, right=True) - 1
    if a_start.numel():
        addr = torch.where(in_a, a_addr[ia] + cuts - a_start[ia], b_addr[ib] + cuts - b_start[ib])
    else:
        addr = b_addr[ib] + cuts - b_start[ib]
    slot = torch.where(in_a, torch.full_like(cuts, a_slot), b_slot[ib])
    keep = torch.ones_like(cuts, dtype=torch.bool)
    keep[1:] = (slot[1:] != slot[:-1]) | (addr[1:] != addr[:-1] + (cuts[1:] - cuts[:-1]))
    return Segments(cuts[keep].tolist(), slot[keep].tolist(), addr[keep].tolist())


class SampleProgram:
    """One layout's sample on one side, compiled once; `launch` enqueues a step's per-entry sums.

    Storage slots: first the manifest's buckets (this step's mapping of each, passed to `launch`), then
    `fixed` storages (the reader's parameters), which stay where they are."""

    def __init__(
        self,
        entries: Sequence[PlacedEntry],
        segments: Sequence[Segments],
        buckets: Sequence[int],
        fixed: Sequence[torch.Tensor],
        period: int,
        device: torch.device,
        *,
        chunk: int = CHUNK_BYTES,
        kernel: bool = True,
    ) -> None:
        if period < 1 or chunk < 1:
            raise ValueError(f"digest period {period} and chunk {chunk} must be positive")
        device = indexed(device)  # type: ignore[assignment]  (compared with the tensors' devices below)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.names = tuple(e.name for e in entries)
        self.period, self.chunk, self.device = period, chunk, device
        self.buckets = tuple(buckets)
        self.fixed = tuple(fixed)  # uint8 over each storage: keeps them alive, and the torch path reads them
        tables = _tables([e.nbytes for e in entries], [e.name for e in entries], segments, period, chunk)
        self.nchunks = int(tables["chunk_entry"].numel())
        self.aligned = int(tables["aligned"][0])  # chunks that lie in one segment each (the fast launch)
        self.sampled_bytes = self.nchunks * chunk  # at most, a step
        # On CPU only where Triton is interpreted (the tests check the kernel against the torch path there).
        self._kernel = _kernel_module() if kernel and (device.type == "cuda" or _interpreted()) else None
        if any(t.device != device for t in self.fixed):
            self._kernel = None
        self.t = {k: v.to(device) for k, v in tables.items()}
        self._out = torch.zeros(self.nchunks + 1, dtype=torch.int64, device=device)
        self._cs = torch.empty_like(self._out)
        if self._kernel is not None:
            self._base = torch.empty(16, dtype=torch.uint8, device=device)
            base = self._base.data_ptr()
            deltas = [0] * len(self.buckets) + [t.data_ptr() - base for t in self.fixed]
            self._delta = torch.tensor(deltas, dtype=torch.int64, device=device)
            pinned = device.type == "cuda"
            self._host = torch.zeros(max(1, len(self.buckets)), dtype=torch.int64, pin_memory=pinned)
        # What the program keeps allocated on the device while its layout lives (a step allocates nothing
        # that outlives it): what a check of the process's memory after a step must allow for.
        self.device_bytes = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else 0

    def launch(self, step: int, bucket: Bucket) -> torch.Tensor:
        """Enqueue step `step`'s per-entry sums (int64, on the device) on the current stream. The buckets
        must stay mapped until the work is done (the caller synchronizes before it closes them)."""
        if self.nchunks:
            if self._kernel is not None:
                self._launch_kernel(step, bucket)
            else:
                self._out[1:] = self._torch_sums(step, bucket)
        torch.cumsum(self._out, 0, out=self._cs)
        return self._cs.index_select(0, self.t["ends"]) - self._cs.index_select(0, self.t["starts"])

    def _launch_kernel(self, step: int, bucket: Bucket) -> None:
        nb = len(self.buckets)
        if nb:
            base = self._base.data_ptr()
            self._host[:nb] = torch.tensor([bucket(i).data_ptr() - base for i in self.buckets])
            self._delta[:nb].copy_(self._host[:nb], non_blocking=True)
        t = self.t
        assert self._kernel is not None
        for row0, end, per_byte in ((0, self.aligned, False), (self.aligned, self.nchunks, True)):
            if end > row0:
                self._kernel.digest_chunks[(triton_blocks(end - row0),)](
                    self._base,
                    self._delta,
                    t["seg_start"],
                    t["seg_slot"],
                    t["seg_addr"],
                    t["chunk_entry"],
                    t["chunk_q0"],
                    t["chunk_lo"],
                    t["chunk_hi"],
                    t["chunk_depth"],
                    t["ent_period"],
                    t["ent_salt"],
                    t["ent_nbytes"],
                    self._out,
                    row0,
                    end,
                    step,
                    CHUNK=self.chunk,
                    BLOCK=BLOCK,
                    PER_BYTE=per_byte,
                    num_warps=4,
                )

    def _torch_sums(self, step: int, bucket: Bucket) -> torch.Tensor:
        """The kernel's arithmetic in torch: the reference, and the path without Triton."""
        t = self.t
        ce = t["chunk_entry"].long()
        q = t["chunk_q0"] + ((t["ent_salt"][ce] + step) % t["ent_period"][ce]) * self.chunk
        x = q[:, None] + torch.arange(self.chunk, device=self.device)[None, :]
        valid = (x < t["ent_nbytes"][ce][:, None]).reshape(-1)
        logical = (t["ent_base"][ce][:, None] + x).reshape(-1)
        seg = _searchsorted(t["seg_gstart"], logical) - 1
        flat_x = x.reshape(-1)
        offset = t["seg_addr"][seg] + (flat_x - t["seg_start"][seg])
        slot = t["seg_slot"][seg]
        idx = valid.nonzero().squeeze(1)
        values = torch.zeros(flat_x.numel(), dtype=torch.int64, device=self.device)
        values[idx] = self._gather(slot[idx], offset[idx], bucket).to(torch.int64)
        w = (((flat_x & 0x7FFFFFFF) * _W_MUL) >> 8) & 0xFFFFFF | 1
        return (values * w).view(-1, self.chunk).sum(1)

    def _gather(self, slot: torch.Tensor, offset: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        order = torch.argsort(slot, stable=True)
        nslots = len(self.buckets) + len(self.fixed)
        counts = torch.bincount(slot, minlength=nslots).tolist()
        parts = []
        for s, part in enumerate(torch.split(offset[order], counts)):
            if part.numel():
                flat = bucket(self.buckets[s]) if s < len(self.buckets) else self.fixed[s - len(self.buckets)]
                parts.append(flat.reshape(-1).view(torch.uint8)[part])
        out = torch.empty(offset.numel(), dtype=torch.uint8, device=self.device)
        if parts:
            out[order] = torch.cat(parts)
        return out

    @staticmethod
    def finish(sums: torch.Tensor) -> bytes:
        """The per-entry digests as the manifest carries them: little-endian uint16 each (a device read)."""
        return (sums.cpu().numpy() & 0xFFFF).astype(DIGEST_DTYPE).tobytes()


def _searchsorted(sorted_: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """torch.searchsorted(right=True); numpy's on CPU, where torch's splits even a few hundred values over
    its thread pool (milliseconds on a busy host, against microseconds)."""
    if sorted_.device.type != "cpu":
        return torch.searchsorted(sorted_, values, right=True)
    return torch.from_numpy(np.searchsorted(sorted_.numpy(), values.numpy(), side="right"))


def triton_blocks(nchunks: int) -> int:
    return -(-nchunks // BLOCK)


def _tables(
    nbytes: Sequence[int], names: Sequence[str], segments: Sequence[Segments], period: int, chunk: int
) -> dict[str, torch.Tensor]:
    """Per entry, per segment and per chunk tables (CPU, int64 unless said), all vectorised. Chunks are in
    entry order, the entries whose segments all start on a chunk boundary first (`aligned` of them)."""
    i64 = torch.int64
    n = torch.tensor(list(nbytes), dtype=i64)
    p = torch.clamp(torch.minimum(torch.full_like(n, period), (n + chunk - 1) // chunk), min=1)
    salt = torch.tensor([zlib.crc32(name.encode()) for name in names], dtype=i64) % p
    window = p * chunk
    per_entry = torch.where(n > 0, (n + window - 1) // window, torch.zeros_like(n))
    ent_base = torch.cumsum(n, 0) - n
    counts = torch.tensor([len(s.start) for s in segments], dtype=i64)
    for name, s in zip(names, segments, strict=True):
        if not s.start or s.start[0] != 0:
            raise ValueError(f"{name}: digest segments must start at logical byte 0")
    seg_start = torch.tensor([x for s in segments for x in s.start], dtype=i64)
    seg_gstart = ent_base.repeat_interleave(counts) + seg_start
    odd = torch.zeros(n.numel(), dtype=i64).index_add_(
        0, torch.arange(n.numel()).repeat_interleave(counts), (seg_start % chunk != 0).to(i64)
    )
    order = torch.argsort((odd > 0).to(i64), stable=True)  # the aligned entries first
    per_chunk = per_entry[order]
    chunk_entry = torch.repeat_interleave(order, per_chunk)
    first = torch.cumsum(per_chunk, 0) - per_chunk  # each entry's first chunk row, in `order`
    starts = torch.empty_like(first)
    starts[order] = first
    q0 = (torch.arange(chunk_entry.numel(), dtype=i64) - starts[chunk_entry]) * window[chunk_entry]
    gq = ent_base[chunk_entry] + q0
    last = ent_base[chunk_entry] + torch.minimum(q0 + window[chunk_entry], n[chunk_entry]) - 1
    lo = torch.searchsorted(seg_gstart, gq, right=True) - 1
    hi = torch.searchsorted(seg_gstart, last, right=True) - 1
    depth = torch.ceil(torch.log2((hi - lo + 1).clamp(min=1).double())).to(torch.int32)
    return {
        "ent_nbytes": n,
        "ent_period": p,
        "ent_salt": salt,
        "ent_base": ent_base,
        "seg_start": seg_start,
        "seg_gstart": seg_gstart,
        "seg_slot": torch.tensor([x for s in segments for x in s.slot], dtype=i64),
        "seg_addr": torch.tensor([x for s in segments for x in s.addr], dtype=i64),
        "chunk_entry": chunk_entry.to(torch.int32),
        "chunk_q0": q0,
        "chunk_lo": lo.to(torch.int32),
        "chunk_hi": hi.to(torch.int32),
        "chunk_depth": depth,
        "starts": starts,  # per entry, its chunks are rows [starts, ends): its sum is cs[ends] - cs[starts]
        "ends": starts + per_entry,
        "aligned": per_entry[odd == 0].sum().reshape(1),
    }


def trainer_program(
    entries: Sequence[PlacedEntry], buckets: Sequence[int], period: int, device: torch.device
) -> SampleProgram:
    """The trainer's sample: every entry where it lies in the step's buckets."""
    slot = {index: s for s, index in enumerate(buckets)}
    segments = [source_segments(e, slot[e.bucket]) for e in entries]
    return SampleProgram(entries, segments, buckets, (), period, device)


def reader_program(
    entries: Sequence[PlacedEntry],
    buckets: Sequence[int],
    targets: Mapping[str, torch.Tensor],
    target_shards: Mapping[str, TensorShard],
    quantized: frozenset[str],
    period: int,
    device: torch.device,
) -> SampleProgram:
    """The reader's sample: every entry where this rank installed it (`quantized`: targets quantized on the
    copy, hashed at the bucket), the rest in the step's buckets."""
    slot = {index: s for s, index in enumerate(buckets)}
    storages: dict[int, int] = {}
    fixed: list[torch.Tensor] = []

    def storage(view: torch.Tensor) -> tuple[int, int]:
        st = view.untyped_storage()
        key = st.data_ptr()
        if key not in storages:
            storages[key] = len(buckets) + len(fixed)
            fixed.append(torch.empty(0, dtype=torch.uint8, device=view.device).set_(st))
        return storages[key], view.data_ptr() - key

    segments = []
    for e in entries:
        source = source_segments(e, slot[e.bucket])
        target = None if e.name in quantized else targets.get(e.name)
        segments.append(installed_segments(e, target, target_shards.get(e.name), source, storage))
    return SampleProgram(entries, segments, buckets, fixed, period, device)


def mismatches(names: Sequence[str], mine: bytes, theirs: bytes) -> list[str]:
    """The parameters whose digests differ (each named once, in manifest order)."""
    a = np.frombuffer(mine, dtype=DIGEST_DTYPE)
    b = np.frombuffer(theirs, dtype=DIGEST_DTYPE)
    if a.shape != b.shape:
        raise ValueError(f"{a.size} digests against {b.size}: not the same layout")
    return list(dict.fromkeys(names[i] for i in np.nonzero(a != b)[0].tolist()))


def warm_up(device: torch.device) -> None:
    """Compile the kernel now (a second or so, once per process), not in the first step."""
    if device.type != "cuda" or _kernel_module() is None:
        return
    entry = PlacedEntry("warm-up", "uint8", (4096,), 0, 0, 4096)
    flat = torch.arange(4096, device=device).to(torch.uint8)
    program = trainer_program([entry], [0], 4, device)
    got = program.launch(1, lambda _: flat)
    program._kernel = None
    if not torch.equal(got, program.launch(1, lambda _: flat)):
        raise RuntimeError("the digest kernel disagreed with the torch path in its warm-up")
