"""The weights check of every step: both sides hash the same small sample of every entry, chosen by the step.

What is hashed. Each manifest entry is read as its own logical bytes (its elements in row-major order, raw
bits). The trainer hashes the sampled bytes where it published them (its bucket, or its own storage in
place). The reader hashes the same logical bytes where they were installed: the destination elements of the
part of the entry this rank holds. It finds them from the target and shard boxes itself, not from the copy
program, so a stale, half-written or mis-mapped install is caught as well as a bad transport. Bytes this
rank does not install are hashed from its mapping of the bucket instead, so only their transport is
checked. That covers an entry with no parameter here, a part left to the exchange, and block-FP8 targets,
whose installed bytes are a quantization of the entry.

The sample. Chunks of `CHUNK_BYTES` (256) logical bytes: two 128-byte lines, so a step reads few places,
each whole. An entry of n bytes has period p = min(P, ceil(n / 256)), where P is the trainer's
`COLOCATE_WEIGHT_DIGEST_PERIOD`, and windows of g = 256 p bytes. Step s reads the chunk at
256 ((s + crc32(name)) mod p) of every window. So each step reads 1/P of every entry, and at least one chunk
of every entry. Any P consecutive steps read every byte of every entry: that is the coverage bound. A
corruption spanning g + 256 contiguous bytes of an entry (256 KiB at P = 1024; a whole parameter, a bucket
region) is caught in the step it happens. A single flipped byte is caught within P steps. The chunk travels
in the manifest, so the reader samples whatever the trainer chose (any power of two up to 4096).

The hash. Per entry, the low 16 bits of sum(byte * w(pos)), where w(pos) is an odd 24-bit multiplicative
hash of the byte's logical position. A change of one byte always changes it (an odd w times a change below
2^8 is never a multiple of 2^16), and so do bytes that moved, but for a 2^-16 chance per entry and step
when many bytes change. Sums are kept modulo 2^32 (all the digest needs). The manifest carries the trainer's
values (2 bytes an entry). The reader compares and names, in its ACK, the parameters that differ.

Cost. The tables are built once per layout: per tile (up to `TILE` chunks of one entry, one kernel program,
one row of the tile table), its entry's sampling, and either the one segment all its chunks lie in or the
few segments its windows touch (searched per chunk, or per byte for entries whose segments do not start on
chunk boundaries). A step is one replay of a CUDA graph (digest_launch.py): the step number and the
buckets' bases copied up, the Triton kernel (loading from absolute addresses, each storage's base given
relative to one base tensor as in fastcopy.py, one atomic add per tile), the sums copied down into pinned
memory. On an H200-class GPU a Qwen3-30B-A3B rank's sample (18,867 entries, 57 MB of 61 GB at P = 1024)
takes about 0.1 ms of device time and 35 us of host time per side (bench/digest_bench.py). Without Triton,
or on CPU, the same arithmetic runs in torch.
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

from colocate_runtime.colocated import digest_launch, strided
from colocate_runtime.colocated.buckets import PlacedEntry
from colocate_runtime.colocated.views import dtype_name, indexed
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard

log = logging.getLogger(__name__)

CHUNK_BYTES = 256  # two 128-byte lines: a step reads ~0.1 % of the bytes in as few places as it can
MAX_CHUNK_BYTES = 4096
DIGEST_DTYPE = "<u2"  # per entry on the wire: 2 bytes (18,867 entries of Qwen3-30B-A3B: 37 KB a step)
TILE = 4  # chunks per kernel program (all of one entry): one atomic add each (fastest on an H200)
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


def chunk_supported(chunk: int) -> bool:
    """A chunk this side can sample: the kernel's blocks need a power of two."""
    return 0 < chunk <= MAX_CHUNK_BYTES and chunk & (chunk - 1) == 0


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
        tile: int = TILE,
        kernel: bool = True,
    ) -> None:
        if period < 1 or tile < 1 or not chunk_supported(chunk):
            raise ValueError(
                f"digest period {period} and tile {tile} must be positive, chunk {chunk} a power of two "
                f"up to {MAX_CHUNK_BYTES}"
            )
        device = indexed(device)  # type: ignore[assignment]  (compared with the tensors' devices below)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.names = tuple(e.name for e in entries)
        self.period, self.chunk, self.tile, self.device = period, chunk, tile, device
        self.buckets = tuple(buckets)
        self.fixed = tuple(fixed)  # uint8 over each storage: keeps them alive, and the torch path reads them
        tables = _tables(
            [e.nbytes for e in entries], [e.name for e in entries], segments, period, chunk, tile
        )
        self.nchunks = int(tables["chunk_entry"].numel())
        self.ntiles = int(tables["tile_entry"].numel())
        self.aligned = int(tables["aligned"][0])  # tiles of entries cut on chunk boundaries (the fast launch)
        self.sampled_bytes = self.nchunks * chunk  # at most, a step
        # On CPU only where Triton is interpreted (the tests check the kernel against the torch path there).
        kernel_module = _kernel_module() if kernel and (device.type == "cuda" or _interpreted()) else None
        if any(t.device != device for t in self.fixed):
            kernel_module = None
        self._tables = tables  # host copies; the torch path moves what it reads to the device once, if used
        self._kernel: digest_launch.KernelLaunch | None = None
        if kernel_module is not None:
            self._kernel = digest_launch.KernelLaunch(
                kernel_module,
                tables,
                (len(entries), self.ntiles, self.aligned),
                len(self.buckets),
                self.fixed,
                device,
                {"CHUNK": chunk, "TILE": tile},
            )
        self._torch_only = False  # the tests compare both paths on one program
        self._out: torch.Tensor | None = None  # the torch path's sums of the last launch
        # What the program keeps allocated on the device while its layout lives (a step allocates nothing
        # that outlives it): what a check of the process's memory after a step must allow for.
        self.device_bytes = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else 0

    def launch(self, step: int, bucket: Bucket) -> torch.Tensor:
        """Enqueue step `step`'s per-entry sums (modulo 2**32, as int32, on the device) on the current
        stream. The buckets must stay mapped until the work is done (the caller synchronizes before it
        closes them)."""
        if self._kernel is None or self._torch_only:
            self._out = self._torch_sums(step, bucket)
            return self._out
        self._kernel.launch(step, [bucket(i).data_ptr() for i in self.buckets])
        return self._kernel.out

    def finish(self, sums: torch.Tensor) -> bytes:
        """The per-entry digests as the manifest carries them: little-endian uint16 each. The kernel's
        come back with its launch (into pinned memory): this waits for them."""
        if self._kernel is not None and sums is self._kernel.out:
            host = self._kernel.read().numpy()
        else:
            host = sums.cpu().numpy()
        return (host & 0xFFFF).astype(DIGEST_DTYPE).tobytes()

    @functools.cached_property
    def _ref(self) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in self._tables.items() if k not in ("aligned",)}

    def _torch_sums(self, step: int, bucket: Bucket) -> torch.Tensor:
        """The kernel's arithmetic in torch: the reference, and the path without Triton."""
        t = self._ref
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
        per_chunk = (values * w).view(-1, self.chunk).sum(1)
        sums = torch.zeros(len(self.names), dtype=torch.int64, device=self.device).index_add_(
            0, ce, per_chunk
        )
        return ((sums & 0xFFFFFFFF) - ((sums & 0x80000000) << 1)).to(torch.int32)  # modulo 2**32, as int32

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


def _searchsorted(sorted_: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """torch.searchsorted(right=True); numpy's on CPU, where torch's splits even a few hundred values over
    its thread pool (milliseconds on a busy host, against microseconds)."""
    if sorted_.device.type != "cpu":
        return torch.searchsorted(sorted_, values, right=True)
    return torch.from_numpy(np.searchsorted(sorted_.numpy(), values.numpy(), side="right"))


def _tables(
    nbytes: Sequence[int],
    names: Sequence[str],
    segments: Sequence[Segments],
    period: int,
    chunk: int,
    tile: int,
) -> dict[str, torch.Tensor]:
    """Per entry, per segment, per chunk and per tile tables (CPU, int64 unless said), all vectorised.
    Chunks are in entry order, the entries whose segments all start on a chunk boundary first; a tile is
    up to `tile` consecutive chunks of one entry (`aligned`: the tiles of those first entries)."""
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
    seg_slot = torch.tensor([x for s in segments for x in s.slot], dtype=i64)
    seg_addr = torch.tensor([x for s in segments for x in s.addr], dtype=i64)
    tiles = _tile_tables(
        per_chunk,
        order,
        first,
        {"lo": lo, "hi": hi, "depth": depth, "q0": q0},
        {"period": p, "salt": salt, "nbytes": n},
        {"start": seg_start, "slot": seg_slot, "addr": seg_addr},
        tile,
    )
    aligned_tiles = (-(-per_entry[odd == 0] // tile)).sum().reshape(1)
    return {
        **tiles,
        "ent_nbytes": n,
        "ent_period": p,
        "ent_salt": salt,
        "ent_base": ent_base,
        "seg_start": seg_start,
        "seg_gstart": seg_gstart,
        "seg_slot": seg_slot,
        "seg_addr": seg_addr,
        "chunk_entry": chunk_entry.to(torch.int32),
        "chunk_q0": q0,
        "chunk_lo": lo.to(torch.int32),
        "chunk_hi": hi.to(torch.int32),
        "aligned": aligned_tiles,
    }


def _tile_tables(
    per_chunk: torch.Tensor,
    order: torch.Tensor,
    first: torch.Tensor,
    chunk: dict[str, torch.Tensor],
    entry: dict[str, torch.Tensor],
    seg: dict[str, torch.Tensor],
    tile: int,
) -> dict[str, torch.Tensor]:
    """Tiles of up to `tile` chunk rows of one entry, in row order. Each carries what its kernel program
    needs at once (one round of loads): its entry and that entry's sampling, its first window's logical
    byte, and its rows' deepest segment search, or, where all its rows lie in one segment (depth -1), that
    segment's slot and how far its storage bytes sit from its logical ones."""
    i64 = torch.int64
    per_tile = -(-per_chunk // tile)  # per entry in `order`
    owner = torch.repeat_interleave(torch.arange(order.numel(), dtype=i64), per_tile)
    j = torch.arange(owner.numel(), dtype=i64) - (torch.cumsum(per_tile, 0) - per_tile)[owner]
    row0 = first[owner] + j * tile
    rows = torch.minimum(torch.full_like(row0, tile), per_chunk[owner] - j * tile)
    of_row = torch.repeat_interleave(torch.arange(owner.numel(), dtype=i64), rows)
    depth = chunk["depth"]
    deepest = torch.zeros(owner.numel(), dtype=torch.int32).scatter_reduce(0, of_row, depth, "amax")
    lo = chunk["lo"][row0]
    one = lo == chunk["hi"][row0 + rows - 1]
    ent = order[owner]
    return {
        "tile_entry": ent.to(torch.int32),
        "tile_row0": row0,
        "tile_rows": rows.to(torch.int32),
        "tile_depth": torch.where(one, torch.full_like(deepest, -1), deepest),
        "tile_q0": chunk["q0"][row0],
        "tile_period": entry["period"][ent],
        "tile_salt": entry["salt"][ent],
        "tile_nbytes": entry["nbytes"][ent],
        "tile_slot": seg["slot"][lo],
        "tile_moved": seg["addr"][lo] - seg["start"][lo],
    }


def trainer_program(
    entries: Sequence[PlacedEntry],
    buckets: Sequence[int],
    period: int,
    device: torch.device,
    *,
    chunk: int = CHUNK_BYTES,
    tile: int = TILE,
) -> SampleProgram:
    """The trainer's sample: every entry where it lies in the step's buckets."""
    slot = {index: s for s, index in enumerate(buckets)}
    segments = [source_segments(e, slot[e.bucket]) for e in entries]
    return SampleProgram(entries, segments, buckets, (), period, device, chunk=chunk, tile=tile)


def reader_program(
    entries: Sequence[PlacedEntry],
    buckets: Sequence[int],
    targets: Mapping[str, torch.Tensor],
    target_shards: Mapping[str, TensorShard],
    quantized: frozenset[str],
    period: int,
    device: torch.device,
    *,
    chunk: int = CHUNK_BYTES,
    tile: int = TILE,
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
    return SampleProgram(entries, segments, buckets, fixed, period, device, chunk=chunk, tile=tile)


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
    got = program.launch(1, lambda _: flat).clone()
    program._torch_only = True
    if not torch.equal(got, program.launch(1, lambda _: flat)):
        raise RuntimeError("the digest kernel disagreed with the torch path in its warm-up")
