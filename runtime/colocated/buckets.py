"""Bucket planning: pack named tensors into few dtype-grouped byte buckets (pure data, no torch).

One IPC handle per parameter exhausted the driver in production (4636 handles for 4888 parameters made
`cudaIpcOpenMemHandle` fail with >50 GB free), so tensors are packed into buckets keyed by dtype alone, each
at most `bucket_bytes` (a tensor larger than that gets a bucket of its own). Inside a dtype the input order is
kept; entry offsets are aligned so every view is aligned for any dtype and vectorised copies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from colocate_runtime.shards import DTYPE_BYTES, ShardError, TensorShard, dtype_bytes, stable_hash

ALIGN_BYTES = 256


class BucketPlanError(ValueError):
    """Input that cannot be packed (the message names the tensor)."""


@dataclass(frozen=True, slots=True)
class EntrySpec:
    """What the planner needs to know about one tensor: no data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: TensorShard | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class PlacedEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes from the start of the bucket
    nbytes: int
    shard: TensorShard | None = None
    # An entry read in place from the trainer's own storage (inplace.py): the strided view (shape, strides in
    # elements) at `offset` whose row-major order is the entry's data. None: packed contiguously.
    view: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def to_json(self) -> dict:
        data = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bucket": self.bucket,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        if self.shard is not None:
            data["shard"] = self.shard.to_json()
        if self.view is not None:
            data["view"] = [list(self.view[0]), list(self.view[1])]
        return data


@dataclass(frozen=True, slots=True)
class BucketSpec:
    index: int
    dtype: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class BucketPlan:
    buckets: tuple[BucketSpec, ...]
    entries: tuple[PlacedEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def layout_hash(self) -> str:
        """Equal for equal layouts: a reader can tell that a step's layout differs from the last one."""
        return stable_hash([e.to_json() for e in self.entries])

    def entries_of(self, bucket: int) -> list[PlacedEntry]:
        return [e for e in self.entries if e.bucket == bucket]


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def plan_buckets(specs: Iterable[EntrySpec], bucket_bytes: int, *, align: int = ALIGN_BYTES) -> BucketPlan:
    """Deterministic packing: same specs and cap, same plan on every rank and every step."""
    if bucket_bytes <= 0:
        raise BucketPlanError(f"bucket size must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[EntrySpec]] = {}
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise BucketPlanError(f"{spec.name}: appears twice in one step")
        seen.add(spec.name)
        try:
            dtype_bytes(spec.dtype)
        except ShardError as err:
            raise BucketPlanError(f"{spec.name}: {err}") from None
        if any(d < 0 for d in spec.shape):
            raise BucketPlanError(f"{spec.name}: negative dimension in shape {spec.shape}")
        if spec.shard is not None and (
            spec.shard.dtype != spec.dtype or spec.shard.box.lengths != spec.shape
        ):
            raise BucketPlanError(
                f"{spec.name}: tensor {spec.dtype}{list(spec.shape)} does not match its shard "
                f"{spec.shard.dtype}{list(spec.shard.box.lengths)}"
            )
        by_dtype.setdefault(spec.dtype, []).append(spec)

    buckets: list[BucketSpec] = []
    entries: list[PlacedEntry] = []
    for dtype, group in by_dtype.items():
        index, used = len(buckets), 0
        for spec in group:
            size = spec.nbytes
            if used > 0 and used + size > bucket_bytes:
                buckets.append(BucketSpec(index, dtype, used))
                index, used = len(buckets), 0
            entries.append(PlacedEntry(spec.name, dtype, spec.shape, index, used, size, spec.shard))
            used = align_up(used + size, align)
        buckets.append(BucketSpec(index, dtype, max(used, align)))
    return BucketPlan(tuple(buckets), tuple(entries))


def check_plan(plan: BucketPlan, bucket_bytes: int | None = None, *, align: int = ALIGN_BYTES) -> None:
    """Raise if entries overlap, leave their bucket, mix dtypes or break alignment (decoded plans too)."""
    sizes = {b.index: b for b in plan.buckets}
    if sorted(sizes) != list(range(len(plan.buckets))):
        raise BucketPlanError(f"bucket indices {sorted(sizes)} are not 0..{len(plan.buckets) - 1}")
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for e in plan.entries:
        bucket = sizes.get(e.bucket)
        if bucket is None:
            raise BucketPlanError(f"{e.name}: bucket {e.bucket} does not exist")
        if e.dtype != bucket.dtype:
            raise BucketPlanError(f"{e.name}: dtype {e.dtype} in a {bucket.dtype} bucket")
        if e.dtype not in DTYPE_BYTES:
            raise BucketPlanError(f"{e.name}: unsupported dtype {e.dtype!r}")
        expected = math.prod(e.shape) * DTYPE_BYTES[e.dtype]
        if e.nbytes != expected:
            raise BucketPlanError(f"{e.name}: {e.nbytes} bytes recorded, shape and dtype give {expected}")
        if e.view is not None:
            _check_view(e, bucket.nbytes)  # views of the trainer's storage may interleave: no overlap check
            continue
        if e.offset < 0 or e.offset % align or e.offset + e.nbytes > bucket.nbytes:
            raise BucketPlanError(
                f"{e.name}: bytes [{e.offset}, {e.offset + e.nbytes}) outside bucket {e.bucket} "
                f"of {bucket.nbytes} bytes or misaligned"
            )
        spans.setdefault(e.bucket, []).append((e.offset, e.offset + e.nbytes, e.name))
    for index, items in spans.items():
        items.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(items):
            if start < end:
                raise BucketPlanError(f"{a} and {b} overlap in bucket {index}")
        nonempty = [end for start, end, _ in items if end > start]
        if bucket_bytes is not None and len(nonempty) > 1 and max(nonempty) > bucket_bytes:
            raise BucketPlanError(
                f"bucket {index} holds {max(nonempty)} bytes, more than the cap {bucket_bytes}"
            )


def _check_view(e: PlacedEntry, bucket_nbytes: int) -> None:
    """A strided entry reads only inside its bucket: its last element's byte ends within it."""
    shape, strides = e.view  # type: ignore[misc]
    esize = DTYPE_BYTES[e.dtype]
    if (
        len(shape) != len(strides)
        or any(type(n) is not int or n < 0 for n in shape)
        or any(type(s) is not int or s < 0 for s in strides)
        or math.prod(shape) != math.prod(e.shape)
    ):
        raise BucketPlanError(f"{e.name}: view {e.view} does not describe a {list(e.shape)} entry")
    last = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if math.prod(shape) else -1
    if e.offset < 0 or e.offset % esize or e.offset + (last + 1) * esize > bucket_nbytes:
        raise BucketPlanError(
            f"{e.name}: view {e.view} at byte {e.offset} leaves bucket {e.bucket} of {bucket_nbytes} bytes "
            "or is misaligned"
        )


def specs_of(named: Sequence[tuple[str, str, tuple[int, ...]]]) -> list[EntrySpec]:
    """Convenience for tests and benchmarks: `(name, dtype, shape)` triples."""
    return [EntrySpec(n, d, tuple(s)) for n, d, s in named]
