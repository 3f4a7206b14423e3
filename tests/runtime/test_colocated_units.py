"""Pure parts of the colocated path: bucket plans, manifest codec, history guards, forced close, checksums."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate_runtime.colocated import checksum
from colocate_runtime.colocated.buckets import (
    ALIGN_BYTES,
    BucketPlanError,
    EntrySpec,
    check_plan,
    plan_buckets,
    specs_of,
)
from colocate_runtime.colocated.close import ImportScope
from colocate_runtime.colocated.history import UpdateHistory, UpdateRecord
from colocate_runtime.colocated.manifest import (
    Ack,
    BucketRecord,
    LayoutCache,
    LayoutEncoder,
    Manifest,
    ManifestError,
    Producer,
    decode_manifest,
    encode_manifest,
)
from colocate_runtime.colocated.shm import SharedMemoryExporter, SharedMemoryImporter
from colocate_runtime.colocated.transport import TransportError
from colocate_runtime.colocated.views import entry_view
from colocate_runtime.shards import Box, TensorShard

pytestmark = pytest.mark.timeout(120)

DTYPES = ["bfloat16", "float32", "float16", "int64", "uint8"]
spec_lists = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
    min_size=0,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(spec_lists, st.integers(1, 4096))
def test_plan_packs_every_entry_once_grouped_by_dtype(raw: list, cap: int) -> None:
    specs = [EntrySpec(f"p{i}", d, tuple(s)) for i, (d, s) in enumerate(raw)]
    plan = plan_buckets(specs, cap)
    check_plan(plan, cap)
    assert [e.name for e in sorted(plan.entries, key=lambda e: int(e.name[1:]))] == [s.name for s in specs]
    assert all(e.offset % ALIGN_BYTES == 0 for e in plan.entries)
    # Few handles: one bucket per dtype unless the cap forces more, never one that a neighbour could absorb.
    for dtype in {s.dtype for s in specs}:
        buckets = [b for b in plan.buckets if b.dtype == dtype]
        if sum(s.nbytes for s in specs if s.dtype == dtype) <= cap - ALIGN_BYTES * len(specs):
            assert len(buckets) == 1
    # Input order is kept inside a dtype.
    for dtype in DTYPES:
        names = [e.name for e in plan.entries if e.dtype == dtype]
        assert names == [s.name for s in specs if s.dtype == dtype]
    assert plan.layout_hash() == plan_buckets(specs, cap).layout_hash()


def test_plan_handle_count_is_per_dtype_not_per_tensor() -> None:
    specs = specs_of(
        [(f"layer{i}.w", "bfloat16", (128, 64 + i)) for i in range(400)] + [("router.bias", "float32", (64,))]
    )
    plan = plan_buckets(specs, 1 << 30)
    assert len(plan.buckets) == 2
    per_tensor = plan_buckets(specs, 1)
    assert len(per_tensor.buckets) == len(specs)  # the baseline the benchmark compares against


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(BucketPlanError, match="twice"):
        plan_buckets(specs_of([("a", "float32", (2,)), ("a", "float32", (2,))]), 1024)
    with pytest.raises(BucketPlanError, match="a: unsupported"):
        plan_buckets(specs_of([("a", "complex64", (2,))]), 1024)
    shard = TensorShard("w", (8, 4), "float32", Box((0, 0), (4, 4)))
    with pytest.raises(BucketPlanError, match="does not match its shard"):
        plan_buckets([EntrySpec("w", "float32", (8, 4), shard)], 1024)


def _manifest(**over) -> Manifest:
    shard = TensorShard("b", (8, 4), "float32", Box((4, 0), (4, 4)))
    plan = plan_buckets(
        [EntrySpec("a", "bfloat16", (3, 5)), EntrySpec("b", "float32", (4, 4), shard)], 1 << 20
    )
    base = dict(
        job="j",
        namespace="n",
        gen=3,
        step=9,
        gpu="GPU-x",
        weight_version="v9",
        transport="SharedMemory",
        producer=Producer(rank=1, replica=0, pid=42, host="h"),
        buckets=tuple(
            BucketRecord(
                b.index,
                b.dtype,
                b.nbytes,
                {"kind": "SharedMemory", "file": f"f{b.index}", "raw": b"\x00\xff"},
            )
            for b in plan.buckets
        ),
        entries=plan.entries,
        checksums={"a": "1:2:3"},
    )
    base.update(over)
    return Manifest(**base)


def test_kept_buckets_round_trip_and_must_be_buckets_of_the_manifest() -> None:
    kept = _manifest(kept=(0,))
    assert decode_manifest(encode_manifest(kept)).kept == (0,)
    assert Ack.from_json(Ack(status="ok", ipc_closed=True, kept=(0,)).to_json()).kept == (0,)
    with pytest.raises(ManifestError, match=r"keeps buckets \[7\] mapped, which it does not have"):
        decode_manifest(encode_manifest(_manifest(kept=(0, 7))))


def test_manifest_round_trip_and_pinning() -> None:
    m = _manifest()
    blob = encode_manifest(m)
    assert b"\x80\x04" not in blob[:2]  # not a pickle
    assert decode_manifest(blob, expect_gen=3, expect_step=9, expect_gpu="GPU-x") == m
    with pytest.raises(ManifestError, match="step"):
        decode_manifest(blob, expect_step=10)
    with pytest.raises(ManifestError, match="gpu"):
        decode_manifest(blob, expect_gpu="GPU-y")


def test_manifest_rejects_inconsistent_layouts() -> None:
    m = _manifest()
    bad_offset = dataclasses.replace(m.entries[0], offset=m.buckets[0].nbytes)
    with pytest.raises(ManifestError, match="outside bucket"):
        decode_manifest(encode_manifest(_manifest(entries=(bad_offset, m.entries[1]))))
    with pytest.raises(ManifestError, match=r"not valid msgpack|schema"):
        decode_manifest(b"\x80\x04\x95garbage")
    with pytest.raises(ManifestError):
        Ack.from_json('{"schema": 1, "status": "ok", "ipc_closed": false}')


def test_layout_encoder_gives_the_same_bytes_and_follows_layout_changes() -> None:
    enc = LayoutEncoder()
    m = _manifest()
    assert encode_manifest(m, enc) == encode_manifest(m)
    assert encode_manifest(dataclasses.replace(m, step=10), enc) == encode_manifest(
        dataclasses.replace(m, step=10)
    )
    renamed = dataclasses.replace(m.entries[0], name="a2")
    changed = _manifest(entries=(renamed, m.entries[1]))
    assert encode_manifest(changed, enc) == encode_manifest(changed)
    assert decode_manifest(encode_manifest(changed, enc)).entries[0].name == "a2"


def test_layout_cache_reuses_only_an_identical_checked_layout() -> None:
    cache = LayoutCache()
    m = _manifest()
    first = decode_manifest(encode_manifest(m), cache=cache)
    second = decode_manifest(encode_manifest(dataclasses.replace(m, step=10)), expect_step=10, cache=cache)
    assert first == m and second.step == 10 and second.entries is first.entries and cache.hits == 1
    # Pinning and descriptors are still checked on a hit.
    with pytest.raises(ManifestError, match="gpu"):
        decode_manifest(encode_manifest(m), expect_gpu="GPU-y", cache=cache)
    # A different layout is decoded and checked again: a bad one is refused after a good one was cached.
    bad = dataclasses.replace(m.entries[0], offset=m.buckets[0].nbytes)
    with pytest.raises(ManifestError, match="outside bucket"):
        decode_manifest(encode_manifest(_manifest(entries=(bad, m.entries[1]))), cache=cache)
    # Same entries in a smaller bucket: not a hit (the layout check depends on the bucket sizes).
    small = dataclasses.replace(m.buckets[0], nbytes=16)  # entry "a" has 30 bytes
    with pytest.raises(ManifestError, match="outside bucket"):
        decode_manifest(encode_manifest(_manifest(buckets=(small, *m.buckets[1:]))), cache=cache)
    hits = cache.hits
    assert decode_manifest(encode_manifest(m), cache=cache).entries == m.entries and cache.hits == hits + 1
    with pytest.raises(ManifestError, match="not valid msgpack"):
        decode_manifest(encode_manifest(m)[:-3], cache=cache)


def test_history_guards_short_histories() -> None:
    h = UpdateHistory(limit=3)
    assert h.last() is None and h.layout_changed() is None and h.mean_seconds() is None
    assert h.mean_bandwidth() is None
    h.record(UpdateRecord(1, 1, "L1", 100, 0.5))
    assert h.layout_changed() is None  # one entry: nothing to compare, and no crash
    assert h.mean_seconds() == 0.5
    h.record(UpdateRecord(1, 2, "L1", 100, 0.0))
    assert h.layout_changed() is False
    h.record(UpdateRecord(1, 3, "L2", 100, 0.5))
    assert h.layout_changed() is True and len(h) == 3
    h.record(UpdateRecord(1, 4, "L2", 100, 0.5))
    assert len(h) == 3


def test_forced_close_releases_without_gc_when_views_are_dropped(tmp_path) -> None:
    exp = SharedMemoryExporter(tmp_path, "CPU-x")
    imp = SharedMemoryImporter(tmp_path, "CPU-x")
    local = exp.allocate(0, 4096, "t")
    scope = ImportScope()
    scope.add(0, imp.open(local.descriptor, 4096))
    view = scope.bucket(0)[128:256].view(torch.float32)
    view.fill_(1.0)
    del view
    report = scope.close(lambda: None)
    assert report.released and not report.gc_fallback and report.alive == ()
    exp.free([local])
    assert list(tmp_path.iterdir()) == []


def test_forced_close_falls_back_to_gc_for_a_cycle_and_reports_a_leak(tmp_path) -> None:
    exp = SharedMemoryExporter(tmp_path, "CPU-x")
    imp = SharedMemoryImporter(tmp_path, "CPU-x")
    local = exp.allocate(0, 4096, "t")
    gc.disable()
    try:
        scope = ImportScope()
        scope.add(0, imp.open(local.descriptor, 4096))
        cycle: list = [scope.bucket(0)[:64]]
        cycle.append(cycle)  # only the collector can free this view
        del cycle
        report = scope.close(lambda: None)
        assert report.released and report.gc_fallback

        scope = ImportScope()
        scope.add(0, imp.open(local.descriptor, 4096))
        leaked = scope.bucket(0)[:64]  # a live reference: the close must not claim success
        report = scope.close(lambda: None)
        assert not report.released and report.alive == (0,)
        del leaked
    finally:
        gc.enable()
    exp.free([local])


def test_shared_memory_importer_refuses_foreign_descriptors(tmp_path) -> None:
    imp = SharedMemoryImporter(tmp_path, "CPU-x")
    with pytest.raises(TransportError, match="not one this transport creates"):
        imp.open({"kind": "SharedMemory", "uuid": "CPU-x", "file": "../etc/passwd", "nbytes": 8}, 8)
    with pytest.raises(TransportError, match="this reader is on"):
        imp.open({"kind": "SharedMemory", "uuid": "CPU-y", "file": "colocate-a", "nbytes": 8}, 8)
    with pytest.raises(TransportError, match="gone"):
        imp.open({"kind": "SharedMemory", "uuid": "CPU-x", "file": "colocate-a", "nbytes": 8}, 8)


def test_entry_views_alias_the_bucket() -> None:
    plan = plan_buckets(specs_of([("a", "bfloat16", (4, 3)), ("b", "float32", (5,))]), 1 << 20)
    flats = {b.index: torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets}
    for e in plan.entries:
        entry_view(flats[e.bucket], e).fill_(2)
    assert entry_view(flats[plan.entries[1].bucket], plan.entries[1]).tolist() == [2.0] * 5


def test_checksums_catch_a_permutation_and_sample_the_same_names() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    assert checksum.tensor_checksum(t) == checksum.tensor_checksum(t.clone())
    assert checksum.tensor_checksum(t) != checksum.tensor_checksum(t.flip(0))
    names = [f"w{i}" for i in range(50)]
    assert checksum.sample_names(names, 3, 5) == checksum.sample_names(list(reversed(names)), 3, 5)
    assert checksum.sample_names(names, 3, 5) != checksum.sample_names(names, 4, 5)
    assert checksum.sample_names(names, 3, 0) == [] and checksum.sample_names([], 3, 5) == []


# --- CUDA IPC descriptors from the meta-store are untrusted (checked before anything is mapped) -------------

_GOOD_DESCRIPTOR = {
    "kind": "CudaIPC",
    "uuid": "GPU-0b7c1e4a-0000-0000-0000-000000000000",
    "handle": b"c" + bytes(64),
    "storage_nbytes": 4096,
    "storage_offset": 2 << 20,
    "ref_counter_handle": b"/torch_123_4567_8",
    "ref_counter_offset": 17,
    "event_handle": bytes(64),
    "event_sync_required": True,
}


def test_a_wellformed_cuda_ipc_descriptor_passes() -> None:
    from colocate_runtime.colocated.ipc import check_descriptor

    check_descriptor(dict(_GOOD_DESCRIPTOR), 4096)
    check_descriptor({**_GOOD_DESCRIPTOR, "event_handle": None, "event_sync_required": False}, 4096)


@pytest.mark.parametrize(
    ("field", "value", "nbytes"),
    [
        ("storage_offset", -512, 4096),
        ("storage_offset", 1 << 50, 4096),
        ("storage_offset", 100, 4096),  # not a block start
        ("storage_offset", True, 4096),
        ("storage_nbytes", 8192, 4096),  # not the bucket the manifest names
        ("storage_nbytes", 0, 0),
        ("storage_nbytes", "4096", 4096),
        ("ref_counter_offset", -1, 4096),
        ("ref_counter_offset", 10_000, 4096),  # past torch's counter file: an int64 written out of bounds
        ("ref_counter_handle", b"/../../dev/shm/x", 4096),
        ("ref_counter_handle", b"torch_1_2_3", 4096),
        ("ref_counter_handle", b"/torch\x00_1", 4096),
        ("ref_counter_handle", "/torch_1_2_3", 4096),
        ("handle", b"", 4096),
        ("handle", "c" * 65, 4096),
        ("event_handle", bytes(63), 4096),
        ("event_sync_required", 1, 4096),
        ("uuid", "CPU-host-0-0", 4096),
    ],
)
def test_hostile_cuda_ipc_descriptors_are_refused_naming_the_field(
    field: str, value: object, nbytes: int
) -> None:
    from colocate_runtime.colocated.ipc import check_descriptor

    with pytest.raises(TransportError, match=f"descriptor refused: {field}"):
        check_descriptor({**_GOOD_DESCRIPTOR, field: value}, nbytes)
    with pytest.raises(TransportError, match="of kind"):
        check_descriptor({**_GOOD_DESCRIPTOR, "kind": "SharedMemory"}, 4096)
