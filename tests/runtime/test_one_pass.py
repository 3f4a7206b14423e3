"""The one-pass update on CPU: byte runs of strided views, the gather program compiled from a trainer rank's
own storage into SGLang's fused parameters, and bit patterns (NaN payloads included) surviving every path.

The trainer's parameters live in one contiguous buffer like Megatron-core's DDP `param_data`; the CUDA IPC
export of that storage is the GPU part (bench/step_bench.py checks it bitwise on every run). Here the buffer
itself stands in for the reader's mapping of it: the same bytes at the same offsets.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.bits import copy_bits
from colocate_runtime.colocated import strided
from colocate_runtime.colocated.buckets import (
    BucketPlan,
    BucketPlanError,
    BucketSpec,
    PlacedEntry,
    check_plan,
)
from colocate_runtime.colocated.gather import compile_gather
from colocate_runtime.colocated.inplace import InPlaceLayout, LayoutMoved
from colocate_runtime.colocated.manifest import (
    LAYOUT_BY_REFERENCE_BYTES,
    BucketRecord,
    LayoutEncoder,
    Manifest,
    ManifestError,
    Producer,
    decode_manifest,
    encode_manifest,
)
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.shm import SharedMemoryExporter
from colocate_runtime.convert import (
    MegatronLayout,
    MegatronRank,
    SGLangLayout,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.shards import Box
from tests.runtime.canonical_pieces import deliver, deliver_local, flat_bytes, sglang_arena
from tests.runtime.colocated_env import shm_config


def gathered(r: strided.Runs, memory: torch.Tensor) -> torch.Tensor:
    return torch.cat([memory[a : a + n] for a, n in zip(r[0].tolist(), r[1].tolist(), strict=True)])


@pytest.mark.parametrize("seed", range(40))
def test_runs_read_the_same_bytes_as_the_strided_view(seed: int) -> None:
    rng = random.Random(seed)
    base = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8)
    esize = rng.choice([1, 2, 4])
    typed = base.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[esize])
    shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    outer = math.prod(shape)
    view = typed.view(-1)[: outer * 4].view(*shape, 4)  # contiguous ...
    view = view[..., rng.randint(0, 1) :: rng.choice([1, 2])]  # ... then sliced into a strided view
    if rng.random() < 0.5 and view.ndim > 1:
        view = view.transpose(0, -1).transpose(0, -1)  # same view, other route
    r = strided.runs(view.storage_offset() * esize, view.shape, view.stride(), esize)
    assert torch.equal(gathered(r, base), view.contiguous().view(-1).view(torch.uint8))
    # Adjacent runs are merged: a contiguous view is one run.
    if view.is_contiguous():
        assert r[0].numel() == 1


@pytest.mark.parametrize("seed", range(30))
def test_sub_boxes_of_a_strided_piece_select_the_right_bytes(seed: int) -> None:
    rng = random.Random(seed)
    groups, rows, cols = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 5)
    fused = torch.arange(groups * (rows + 3) * cols, dtype=torch.int16).view(groups * (rows + 3), cols)
    view = fused.view(groups, rows + 3, cols)[:, 1 : 1 + rows]  # like q rows of interleaved groups
    logical = view.reshape(groups * rows, cols)
    offsets = (rng.randrange(groups * rows), rng.randrange(cols))
    lengths = (rng.randint(1, groups * rows - offsets[0]), rng.randint(1, cols - offsets[1]))
    whole = strided.runs(view.storage_offset() * 2, view.shape, view.stride(), 2)
    part = strided.select(whole, strided.box_ranges(logical.shape, offsets, lengths, 2))
    want = logical[Box(offsets, lengths).slices()]
    assert torch.equal(gathered(part, flat_bytes(fused)), want.contiguous().view(-1).view(torch.uint8))


def test_segments_cut_both_sides_at_each_others_boundaries() -> None:
    src = (torch.tensor([0, 100]), torch.tensor([6, 4]))
    dst = (torch.tensor([50, 60, 70]), torch.tensor([3, 3, 4]))
    s, d, n = strided.segments(src, dst)
    assert list(zip(s.tolist(), d.tolist(), n.tolist(), strict=True)) == [
        (0, 50, 3),
        (3, 60, 3),
        (100, 70, 4),
    ]
    with pytest.raises(ValueError, match="destination"):
        strided.segments(src, (torch.tensor([0]), torch.tensor([9])))
    ts, td, tn = strided.tiles(torch.tensor([0]), torch.tensor([1000]), torch.tensor([10]), 4)
    assert (ts.tolist(), td.tolist(), tn.tolist()) == ([0, 4, 8], [1000, 1004, 1008], [4, 4, 2])


SPEC = dict(
    model_type="qwen3_moe",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=200,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    dtype="bfloat16",
)


def random_bits(n: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 bit patterns of every kind, NaNs with payloads among them (a float copy may rewrite those)."""
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=generator)
    bits[::7] = torch.tensor(0x7FC1, dtype=torch.int16)  # a quiet NaN with a payload
    bits[3::11] = torch.tensor(-32767, dtype=torch.int16)  # 0x8001: a negative subnormal
    return bits.view(torch.bfloat16)


def megatron_buffer(plan, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The rank's parameters as views of one contiguous buffer, as Megatron-core's DDP holds them."""
    params = [p for chunk in plan.chunks for p in chunk.params if not p.optional]
    buffer = random_bits(sum(math.prod(p.shape) for p in params), generator)
    tensors, at = {}, 0
    for p in params:
        n = math.prod(p.shape)
        tensors[p.names[0]] = buffer[at : at + n].view(p.shape)
        at += n
    return buffer, tensors


def as_bits(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16) for n, t in params.items()}


@pytest.mark.parametrize(
    ("megatron", "rank", "sglang", "sglang_rank"),
    [
        (MegatronLayout(), MegatronRank(), SGLangLayout(tp=1), 0),  # whole model, 4 q/k/v groups interleaved
        (MegatronLayout(), MegatronRank(), SGLangLayout(tp=2, ep=2), 1),  # SGLang holds half of everything
        (MegatronLayout(tp=2, ep=2), MegatronRank(tp_rank=1, ep_rank=1), SGLangLayout(tp=2, ep=2), 1),
    ],
)
def test_gather_from_trainer_storage_equals_the_reference_conversion_bit_for_bit(
    megatron: MegatronLayout, rank: MegatronRank, sglang: SGLangLayout, sglang_rank: int
) -> None:
    spec = model_spec(SPEC)
    tplan = trainer_plan(spec, megatron, rank)
    buffer, tensors = megatron_buffer(tplan, torch.Generator().manual_seed(7))
    iplan = inference_plan(spec, sglang, sglang_rank)
    reference = deliver_local(iplan, tplan.convert(tensors))

    layout = InPlaceLayout.compile(
        tplan.bind(tensors), adoptable=lambda t: True, bucket_bytes=1 << 20, min_adopt_bytes=0
    )
    assert len(layout.adopted) == 1 and not layout.packed  # one handle, nothing packed
    assert all(e.view is not None for e in layout.entries)

    for kernel in (False, True):
        arena, params = sglang_arena(iplan)
        read = iplan.read(params)
        targets = {s.name: v for s, v in read}
        shards = {s.name: s for s, _ in read}
        local = {n: t for n, t in targets.items() if n in reference}
        program = compile_gather(layout.entries, local, shards, torch.device("cpu") if kernel else None)
        if kernel:  # the tile table the GPU kernel runs, applied byte by byte here
            assert not program.slow and set(program.tables) == {0}
            table = program.tables[0]
            memory, out = flat_bytes(buffer), flat_bytes(arena)
            shift = table.dst_base.data_ptr() - out.data_ptr()
            for s, d, n in table.tiles.tolist():
                out[shift + d : shift + d + n] = memory[s : s + n]
        else:
            program.copy_slow(lambda index: flat_bytes(buffer))
        for name, (where, want) in reference.items():
            assert torch.equal(targets[name][where].view(torch.int16), want.view(torch.int16)), name


def test_the_reference_conversion_keeps_nan_payloads() -> None:
    """The reference used above really is bitwise (else the comparison would prove nothing about bits)."""
    spec = model_spec(SPEC)
    tplan = trainer_plan(spec, MegatronLayout(), MegatronRank())
    _, tensors = megatron_buffer(tplan, torch.Generator().manual_seed(3))
    pieces = tplan.convert(tensors)
    params = deliver(inference_plan(spec, SGLangLayout(tp=1), 0), pieces)
    back = torch.cat([t.reshape(-1).view(torch.int16) for t in params.values()])
    assert int((back == 0x7FC1).sum()) > 0  # payload NaNs arrived unchanged


def test_packed_pieces_keep_bits_and_adopt_nothing_without_exportable_memory(tmp_path) -> None:
    spec = model_spec(SPEC)
    tplan = trainer_plan(spec, MegatronLayout(), MegatronRank())
    _, tensors = megatron_buffer(tplan, torch.Generator().manual_seed(5))
    exporter = SharedMemoryExporter(tmp_path, "GPU-test")
    layout = InPlaceLayout.compile(tplan.bind(tensors), adoptable=lambda t: False, bucket_bytes=1 << 16)
    assert not layout.adopted and all(e.view is None for e in layout.entries)
    buckets = layout.stage(exporter, "g1-s1")
    try:
        memory = {b.index: b.tensor for b in buckets}
        for e, source in layout.packed:
            got = memory[e.bucket][e.offset : e.offset + e.nbytes]
            assert torch.equal(got, source.data().contiguous().view(-1).view(torch.uint8)), e.name
    finally:
        exporter.free(buckets)


def test_copy_bits_keeps_nan_payloads() -> None:
    src = random_bits(4096, torch.Generator().manual_seed(1))
    dst = torch.zeros(4096, dtype=torch.bfloat16)
    copy_bits(dst, src)
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))


def one_bucket_manifest(entries: tuple[PlacedEntry, ...], nbytes: int) -> Manifest:
    bucket = BucketRecord(0, "bfloat16", nbytes, {"kind": "SharedMemory"})
    return Manifest("j", "ns", 1, 1, "GPU-x", "1", "SharedMemory", Producer(0, 0, 1, "h"), (bucket,), entries)


def view_entry(view: tuple, offset: int = 0) -> PlacedEntry:
    return PlacedEntry("w", "bfloat16", (4, 8), 0, offset, 64, None, view)


def test_manifest_carries_views_and_refuses_ones_that_leave_their_storage() -> None:
    good = view_entry(((2, 2, 8), (24, 8, 1)))
    plan = BucketPlan((BucketSpec(0, "bfloat16", 80),), (good,))
    check_plan(plan)
    for bad, why in [
        (
            view_entry(((2, 2, 8), (24, 8, 1)), offset=2),
            "leaves bucket",
        ),  # its last element ends past byte 80
        (view_entry(((2, 2, 8), (24, 8, 1)), offset=1), "misaligned"),
        (view_entry(((2, 3, 8), (24, 8, 1))), "does not describe"),
        (view_entry(((32,), (-1,))), "does not describe"),
    ]:
        with pytest.raises(BucketPlanError, match=why):
            check_plan(BucketPlan(plan.buckets, (bad,)))

    def manifest(entry: PlacedEntry) -> bytes:
        return encode_manifest(one_bucket_manifest((entry,), 80))

    assert decode_manifest(manifest(good)).entries[0].view == ((2, 2, 8), (24, 8, 1))
    with pytest.raises(ManifestError, match="leaves bucket"):
        decode_manifest(manifest(view_entry(((2, 2, 8), (24, 8, 1)), offset=32)))


@pytest.fixture
def cfg(redis_server: RedisServer, tmp_path):
    return shm_config(redis_server, tmp_path / "shm")


def many_tensors(step: int) -> dict[str, torch.Tensor]:
    """A layout whose packed entries pass LAYOUT_BY_REFERENCE_BYTES (an MoE rank's thousands of experts)."""
    g = torch.Generator().manual_seed(step)
    return {f"model.layers.{i // 64}.mlp.experts.{i % 64}.w": random_bits(8, g) for i in range(3000)}


def test_a_large_layout_is_stored_once_and_named_by_every_manifest(cfg) -> None:
    from colocate_runtime.colocated.wiring import connect, new_reader, new_writer

    store = connect(cfg)
    targets = {n: torch.zeros_like(t) for n, t in many_tensors(0).items()}
    writer, reader = new_writer(cfg), new_reader(cfg, targets)
    try:
        for step in (1, 2, 3):
            pending = writer.publish(step, many_tensors(step))
            blob = store.read_manifest(writer.gen, step, writer.uuid)
            # The layout is not in the manifest (the weights check's digest is: 2 bytes an entry).
            assert blob is not None and len(blob) < 4096 + 2 * 3000
            reader.apply_next(timeout_s=5)
            writer.wait_and_free(pending)
            got = {n: t.view(torch.int16) for n, t in targets.items()}
            assert all(torch.equal(got[n], t.view(torch.int16)) for n, t in many_tensors(step).items())
        assert reader._layouts.hits == 2  # read and checked once
        layouts = list(store.client.scan_iter(match="*:layout:*"))
        assert len(layouts) == 1 and len(store.client.get(layouts[0])) > LAYOUT_BY_REFERENCE_BYTES

        # A reader that never saw the layout, and the layout gone: a clear error, nothing mapped.
        fresh = new_reader(cfg, targets, preflight=False)
        pending = writer.publish(4, many_tensors(4))
        store.client.delete(layouts[0])
        with pytest.raises(StepFailed, match="does not hold"):
            fresh.apply_next(timeout_s=5)
        with pytest.raises(StepFailed):
            writer.wait_and_free(pending)
        fresh.close()
    finally:
        reader.close()
        writer.close()


def test_a_layout_that_does_not_hash_to_its_name_is_refused() -> None:
    entries = tuple(PlacedEntry(f"w{i}", "bfloat16", (4,), 0, 512 * i, 8) for i in range(4000))
    m = one_bucket_manifest(entries, 512 * 4000)
    encoder = LayoutEncoder()
    blob = encode_manifest(m, encoder, by_reference=True)
    packed = encoder.entries_bytes(entries)
    assert decode_manifest(blob, layouts={encoder.ref: packed}.get).entries == entries
    with pytest.raises(ManifestError, match="does not hash"):
        decode_manifest(blob, layouts=lambda ref: packed[:-1] + b"\x00")
    with pytest.raises(ManifestError, match="does not hold"):
        decode_manifest(blob, layouts=lambda ref: None)


def test_parameters_moved_since_the_layout_was_compiled_are_refused_not_published_stale(tmp_path) -> None:
    """Offloading and reloading the trainer's parameters gives them new storage: the compiled layout would
    publish the old one. Bound to the parameters themselves (state_dict(keep_vars=True)), the move is seen."""
    spec = model_spec(SPEC)
    tplan = trainer_plan(spec, MegatronLayout(), MegatronRank())
    _, tensors = megatron_buffer(tplan, torch.Generator().manual_seed(9))
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in tensors.items()}
    layout = InPlaceLayout.compile(
        tplan.bind(params), adoptable=lambda t: True, bucket_bytes=1 << 20, min_adopt_bytes=0
    )
    exporter = SharedMemoryExporter(tmp_path, "GPU-test")
    exporter.free(layout.stage(exporter, "g1-s1"))  # in place: fine
    moved = torch.cat([p.data.reshape(-1) for p in params.values()]).clone()  # reloaded elsewhere
    at = 0
    for p in params.values():
        p.data = moved[at : at + p.numel()].view(p.shape)
        at += p.numel()
    with pytest.raises(LayoutMoved, match="compile it again"):
        layout.stage(exporter, "g1-s2")
