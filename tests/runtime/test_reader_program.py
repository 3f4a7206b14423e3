"""The reader's copy program (reader_program.py) on its own: compiled from a manifest and run on CPU tensors,
no Redis and no transport. The buckets are plain uint8 tensors packed as the writer packs them."""

from __future__ import annotations

import pytest
import torch

from colocate_runtime.bits import copy_bits
from colocate_runtime.colocated.buckets import EntrySpec, PlacedEntry, plan_buckets
from colocate_runtime.colocated.manifest import BucketRecord, Manifest, Producer
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.reader_program import CopyProgram, ProgramCache, compile_program
from colocate_runtime.colocated.views import dtype_name, entry_view
from colocate_runtime.shards import DTYPE_BYTES, Box, TensorShard


def source(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two dtypes, odd sizes (the plan pads between entries), one 1-element tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, 33, generator=g),
        "b.scale": torch.randn(1, generator=g),
    }


def packed(
    tensors: dict[str, torch.Tensor],
    *,
    shards: dict[str, TensorShard] | None = None,
    bucket_bytes: int = 1 << 20,
) -> tuple[Manifest, dict[int, torch.Tensor]]:
    """The manifest of one step and its buckets, as the writer packs them (writer.publish)."""
    shards = shards or {}
    specs = [EntrySpec(n, dtype_name(t.dtype), tuple(t.shape), shards.get(n)) for n, t in tensors.items()]
    plan = plan_buckets(specs, bucket_bytes)
    buckets = {b.index: torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets}
    for e in plan.entries:
        copy_bits(entry_view(buckets[e.bucket], e), tensors[e.name])
    records = tuple(BucketRecord(b.index, b.dtype, b.nbytes, {}) for b in plan.buckets)
    producer = Producer(0, 0, 1, "h")
    manifest = Manifest("j", "ns", 1, 1, "GPU-x", "1", "SharedMemory", producer, records, plan.entries)
    return manifest, buckets


def poisoned_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, float("nan")) for n, t in tensors.items()}


def run(
    program: CopyProgram,
    manifest: Manifest,
    buckets: dict[int, torch.Tensor],
    targets: dict[str, torch.Tensor],
    shards: dict[str, TensorShard] | None = None,
) -> tuple[dict[str, int], int]:
    """One step's copies, as the reader runs them: every bucket's, then those that need every bucket."""
    for b in manifest.buckets:
        program.copy_bucket(b.index, buckets.__getitem__)
    return program.copy_sharded(buckets.__getitem__, targets, shards or {})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_whole_parameters_copy_bit_for_bit_one_split_per_bucket() -> None:
    src = source()
    manifest, buckets = packed(src)
    targets = poisoned_like(src)
    program = compile_program(manifest, targets, {}, None)
    assert not program.sharded and not program.extra and program.gather is None and program.fp8 is None
    assert set(program.buckets) == {b.index for b in manifest.buckets}  # a bf16 and a float32 bucket
    for b in manifest.buckets:
        bp = program.buckets[b.index]
        assert bp.table is None  # no device: no batched kernel
        # One split covers the whole bucket, alignment padding included.
        assert sum(bp.sizes) * DTYPE_BYTES[b.dtype] == b.nbytes
        assert len(bp.copies) == sum(e.bucket == b.index for e in manifest.entries)
    covered, nbytes = run(program, manifest, buckets, targets)
    assert covered == {n: t.numel() for n, t in src.items()}
    assert nbytes == program.copied_bytes == sum(t.numel() * t.element_size() for t in src.values())
    for name, t in src.items():
        assert same_bits(targets[name], t), name


def test_a_program_runs_every_step_of_its_layout() -> None:
    manifest, buckets = packed(source(0))
    targets = poisoned_like(source(0))
    program = compile_program(manifest, targets, {}, None)
    for seed in (1, 2):
        src = source(seed)
        _, buckets = packed(src)
        run(program, manifest, buckets, targets)
        assert all(same_bits(targets[n], t) for n, t in src.items())


def test_a_non_contiguous_parameter_is_copied_through_its_shape() -> None:
    src = {"w": torch.arange(12, dtype=torch.float32).view(3, 4)}
    manifest, buckets = packed(src)
    storage = torch.zeros(4, 3)
    targets = {"w": storage.t()}  # (3, 4), not contiguous
    program = compile_program(manifest, targets, {}, None)
    ((_, dst, shape),) = program.buckets[0].copies
    assert shape == (3, 4) and dst is targets["w"]
    run(program, manifest, buckets, targets)
    assert torch.equal(targets["w"], src["w"]) and torch.equal(storage, src["w"].t())


def test_entries_without_a_parameter_are_left_to_the_exchange() -> None:
    src = source()
    manifest, buckets = packed(src)
    targets = poisoned_like({n: t for n, t in src.items() if n != "b.weight"})
    program = compile_program(manifest, targets, {}, None)
    assert list(program.extra) == ["b.weight"]
    covered, _ = run(program, manifest, buckets, targets)
    assert "b.weight" not in covered
    assert all(same_bits(targets[n], src[n]) for n in targets)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (torch.zeros(5, 7, dtype=torch.float16), "trainer sent bfloat16, the parameter is float16"),
        (torch.zeros(7, 5, dtype=torch.bfloat16), "trainer sent shape [5, 7], the parameter has [7, 5]"),
    ],
    ids=["dtype", "shape"],
)
def test_an_entry_that_cannot_land_fails_the_step_naming_it(target: torch.Tensor, says: str) -> None:
    manifest, _ = packed(source())
    targets = {**poisoned_like(source()), "a.weight": target}
    with pytest.raises(StepFailed, match=r"a\.weight") as err:
        compile_program(manifest, targets, {}, None)
    assert says in str(err.value) and err.value.step == manifest.step


def shard(
    name: str, shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> TensorShard:
    return TensorShard(name, shape, "float32", Box(offsets, lengths))


def test_a_trainer_shard_fills_its_box_of_a_whole_parameter() -> None:
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    piece = shard("w", (6, 4), (2, 0), (3, 4))  # rows 2..4
    manifest, buckets = packed({"w": full[2:5].clone()}, shards={"w": piece})
    target = torch.full((6, 4), -1.0)
    program = compile_program(manifest, {"w": target}, {}, None)
    assert [e.name for e in program.sharded] == ["w"] and not program.buckets
    covered, nbytes = run(program, manifest, buckets, {"w": target})
    assert covered == {"w": 12} and nbytes == 12 * 4
    assert torch.equal(target[2:5], full[2:5])
    assert (target[:2] == -1).all() and (target[5:] == -1).all()


def test_a_sharded_parameter_takes_the_intersection_with_the_trainer_shard() -> None:
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    trainer = shard("w", (6, 4), (0, 0), (4, 4))  # rows 0..3
    here = shard("w", (6, 4), (2, 0), (4, 4))  # rows 2..5
    manifest, buckets = packed({"w": full[:4].clone()}, shards={"w": trainer})
    target = torch.full((4, 4), -1.0)
    program = compile_program(manifest, {"w": target}, {"w": here}, None)
    covered, nbytes = run(program, manifest, buckets, {"w": target}, {"w": here})
    assert covered == {"w": 8} and nbytes == 8 * 4  # rows 2..3 only
    assert torch.equal(target[:2], full[2:4]) and (target[2:] == -1).all()


def test_a_whole_entry_for_a_sharded_parameter_is_cut_to_its_box() -> None:
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    here = shard("w", (6, 4), (0, 2), (6, 2))  # columns 2..3
    manifest, buckets = packed({"w": full})
    target = torch.full((6, 2), -1.0)
    program = compile_program(manifest, {"w": target}, {"w": here}, None)
    covered, _ = run(program, manifest, buckets, {"w": target}, {"w": here})
    assert covered == {"w": 12} and torch.equal(target, full[:, 2:])


def test_disjoint_shards_copy_nothing() -> None:
    trainer = shard("w", (6, 4), (0, 0), (2, 4))
    here = shard("w", (6, 4), (4, 0), (2, 4))
    manifest, buckets = packed({"w": torch.ones(2, 4)}, shards={"w": trainer})
    target = torch.full((2, 4), -1.0)
    program = compile_program(manifest, {"w": target}, {"w": here}, None)
    covered, nbytes = run(program, manifest, buckets, {"w": target}, {"w": here})
    assert covered.get("w", 0) == 0 and nbytes == 0 and (target == -1).all()


def test_the_program_cache_compiles_a_layout_once() -> None:
    src = source()
    manifest, _ = packed(src)
    targets = poisoned_like(src)
    compiled: list[Manifest] = []

    def compile_(m: Manifest) -> CopyProgram:
        compiled.append(m)
        return compile_program(m, targets, {}, None)

    cache = ProgramCache(size=2)
    first = cache.get(manifest, compile_)
    assert cache.get(manifest, compile_) is first  # the very entries of the last step
    again, _ = packed(source(1))  # the same layout, decoded afresh
    assert again.entries is not manifest.entries and cache.get(again, compile_) is first
    assert len(compiled) == 1 and len(cache) == 1
    other, _ = packed({**src, "c": torch.zeros(2)})
    assert cache.get(other, compile_) is not first and len(compiled) == 2 and len(cache) == 2
    moved = PlacedEntry(**{**vars_of(manifest.entries[0]), "offset": manifest.entries[0].offset + 256})
    shifted = Manifest(**{**vars_of(manifest), "entries": (moved, *manifest.entries[1:])})
    cache.get(shifted, lambda m: CopyProgram())  # a third layout: the cache of two starts over
    assert len(cache) == 1


def vars_of(obj: object) -> dict[str, object]:
    return {name: getattr(obj, name) for name in obj.__slots__}  # type: ignore[attr-defined]


def test_an_in_place_layout_is_one_gather_program() -> None:
    """Entries read from the trainer's own storage (a strided view of it: here a transposed one) compile to
    the gather program (gather.py), which does every local copy of the step."""
    storage = torch.arange(35, dtype=torch.float32)  # the trainer's parameter, stored (7, 5)
    entry = PlacedEntry("w", "float32", (5, 7), 0, 0, 35 * 4, view=((5, 7), (1, 5)))
    bucket = BucketRecord(0, "float32", 35 * 4, {})
    manifest = Manifest(
        "j", "ns", 1, 1, "GPU-x", "1", "SharedMemory", Producer(0, 0, 1, "h"), (bucket,), (entry,)
    )
    target = torch.full((5, 7), -1.0)
    program = compile_program(manifest, {"w": target}, {}, None)
    assert program.gather is not None and not program.buckets and program.copied_bytes == 35 * 4
    covered, nbytes = run(program, manifest, {0: storage.view(torch.uint8)}, {"w": target})
    assert covered == {"w": 35} and nbytes == 35 * 4
    assert torch.equal(target, storage.view(7, 5).t())


@pytest.mark.parametrize("trainer_shard", [False, True], ids=["whole", "own-shard"])
def test_a_parameter_sent_in_another_shape_fails_rather_than_landing_in_part(trainer_shard: bool) -> None:
    """With the engine's shard boxes only the overlap is copied, so a 257-element norm against a 256-element
    parameter would install its first 256 and pass; it must fail, naming both shapes."""
    sent = {"norm.weight": torch.ones(257, dtype=torch.bfloat16)}
    shards = (
        {"norm.weight": TensorShard("norm.weight", (257,), "bfloat16", Box((0,), (257,)))}
        if trainer_shard
        else {}
    )
    manifest, _ = packed(sent, shards=shards)
    targets = {"norm.weight": torch.zeros(256, dtype=torch.bfloat16)}
    engine = {"norm.weight": TensorShard("norm.weight", (256,), "bfloat16", Box((0,), (256,)))}
    with pytest.raises(
        StepFailed, match=r"norm.weight: trainer sent a parameter of shape \[257\], the engine's is \[256\]"
    ):
        compile_program(manifest, targets, engine, None)
