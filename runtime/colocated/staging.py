"""A step's buckets between packing and publishing: filled, not yet exported (`Staged`), the weights check's
sample of them, and the manifest that announces them once they are exported."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from colocate_runtime.bits import copy_bits
from colocate_runtime.colocated import checksum, digest
from colocate_runtime.colocated.buckets import BucketPlan, BucketSpec, EntrySpec, PlacedEntry
from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.colocated.liveness import host_id
from colocate_runtime.colocated.manifest import BucketRecord, Manifest, Producer, WeightDigest
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.colocated.views import dtype_name, entry_view
from colocate_runtime.colocated.writer_settings import WriterSettings
from colocate_runtime.shards import TensorShard

# The weights check's sample of the last layout: its entries, its bucket order, the program.
DigestSample = tuple[tuple[PlacedEntry, ...], tuple[int, ...], digest.SampleProgram]


@dataclass(frozen=True, slots=True)
class Staged:
    """A step's buckets, filled but not yet exported, with their layout."""

    specs: tuple[BucketSpec, ...]
    entries: tuple[PlacedEntry, ...]
    buckets: list[LocalBucket]
    data: Callable[[str], torch.Tensor]  # an entry's data, for sampled checksums
    kept: tuple[int, ...] = ()  # buckets the reader may keep mapped across steps (the trainer's own storage)
    layout: InPlaceLayout | None = None  # the in-place layout, when kept


def entry_specs(tensors: Mapping[str, torch.Tensor], shards: Mapping[str, TensorShard]) -> list[EntrySpec]:
    return [
        EntrySpec(name, dtype_name(t.dtype), tuple(t.shape), shards.get(name)) for name, t in tensors.items()
    ]


def pack(
    exporter: BucketExporter, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], tag: str
) -> list[LocalBucket]:
    """New buckets of `plan`, filled with `tensors` (not yet exported)."""
    buckets = [exporter.allocate(b.index, b.nbytes, tag) for b in plan.buckets]
    try:
        with torch.no_grad():
            for e in plan.entries:
                flat = buckets[e.bucket].tensor
                assert flat is not None
                copy_bits(entry_view(flat, e), tensors[e.name])
    except BaseException:
        exporter.free(buckets)
        raise
    return buckets


def sampled_checksums(staged: Staged, step: int, entries: int) -> dict[str, str]:
    """Checksums of `entries` sampled entries (none when 0): the reader compares them after its copy."""
    if entries <= 0:
        return {}
    names = checksum.sample_names([e.name for e in staged.entries], step, entries)
    values = checksum.tensor_checksums([staged.data(n) for n in names])
    return dict(zip(names, values, strict=True))


def manifest_of(
    settings: WriterSettings,
    staged: Staged,
    *,
    gen: int,
    step: int,
    gpu: str,
    transport: str,
    weight_version: str,
    checksums: dict[str, str],
    digest: WeightDigest | None,
) -> Manifest:
    """The manifest of a staged step whose buckets are exported."""
    return Manifest(
        job=settings.job,
        namespace=settings.namespace,
        gen=gen,
        step=step,
        gpu=gpu,
        weight_version=weight_version,
        transport=transport,
        producer=Producer(settings.rank, settings.replica, os.getpid(), host_id()),
        buckets=tuple(
            BucketRecord(s.index, s.dtype, s.nbytes, b.descriptor or {})
            for s, b in zip(staged.specs, staged.buckets, strict=True)
        ),
        entries=staged.entries,
        checksums=checksums,
        kept=staged.kept,
        digest=digest,
    )


def digest_program(cached: DigestSample | None, staged: Staged, period: int) -> DigestSample:
    """The weights check's sample of the staged layout (digest.py); the cached one while the layout repeats
    (its entries, its bucket order and its period)."""
    order = tuple(s.index for s in staged.specs)
    same = cached is not None and (cached[0] is staged.entries or cached[0] == staged.entries)
    if cached is None or not same or cached[1] != order or cached[2].period != period:
        flat = staged.buckets[0].tensor if staged.buckets else None
        device = flat.device if flat is not None else torch.device("cpu")
        cached = (staged.entries, order, digest.trainer_program(staged.entries, order, period, device))
    return cached


def launch_digest(program: digest.SampleProgram, step: int, staged: Staged) -> torch.Tensor:
    """Enqueue the sample's per-entry sums of the staged buckets."""
    by_index = {b.index: b.tensor for b in staged.buckets}

    def bucket(index: int) -> torch.Tensor:
        flat = by_index[index]
        assert flat is not None
        return flat

    return program.launch(step, bucket)
