"""Pure tests of layouts, plans, the peer schedule and chunking: no processes, no torch.distributed."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colocate_runtime.p2p.chunks import (
    ALIGN,
    aligned,
    assign_chunks,
    plan_chunks,
    rank_schedule,
    shard_shapes,
    split_transfer,
    staged_peak,
)
from colocate_runtime.p2p.config import ExecutorConfig
from colocate_runtime.p2p.layout import Layout, ParamShards, split_box, split_extent
from colocate_runtime.p2p.peers import meeting_round, num_rounds, partner
from colocate_runtime.p2p.plan import (
    PlanError,
    Transfer,
    TransferPlan,
    build_plan,
    describe_shards,
    fingerprint,
    first_difference,
)
from colocate_runtime.shards import Box, RankShards, ShardError, TensorShard
from tests.runtime.p2p_helpers import dense_model, inference_layout, moe_model, trainer_layout

# --- helpers -------------------------------------------------------------------------------------------


def param(
    name: str, shape: tuple[int, ...], shards: list[tuple[int, Box]], dtype: str = "bfloat16"
) -> ParamShards:
    return ParamShards(name, shape, dtype, tuple(sorted(shards, key=lambda s: s[0])))


def coverage_counts(
    plan: TransferPlan, receivers: Layout
) -> dict[tuple[str, int], dict[tuple[int, ...], int]]:
    """For every receiver shard, how often each of its elements is written by the plan."""
    counts: dict[tuple[str, int], dict[tuple[int, ...], int]] = {}
    for t in plan.transfers:
        cell = counts.setdefault((t.name, t.dst), {})
        ranges = [range(o, o + n) for o, n in zip(t.dst_box.offsets, t.dst_box.lengths, strict=True)]
        for point in itertools.product(*ranges):
            cell[point] = cell.get(point, 0) + 1
    return counts


def assert_exact_cover(plan: TransferPlan, senders: Layout, receivers: Layout) -> None:
    counts = coverage_counts(plan, receivers)
    send = senders.by_name()
    for p in receivers.params:
        for rank, box in p.shards:
            cell = counts.get((p.name, rank), {})
            expected = (
                {pt for pt in itertools.product(*[range(n) for n in box.lengths])} if box.numel else set()
            )
            assert set(cell) == expected, f"{p.name} on rank {rank}: covered {len(cell)} of {len(expected)}"
            assert all(v == 1 for v in cell.values()), f"{p.name} on rank {rank}: element written twice"
    for t in plan.transfers:
        src_box = send[t.name].box_of(t.src)
        assert src_box is not None and src_box.offsets == t.src_origin
        assert src_box.contains(t.region), f"{t.name}: rank {t.src} sends {t.region} it does not hold"


# --- layouts -------------------------------------------------------------------------------------------


def test_split_extent_spreads_the_remainder_first() -> None:
    assert split_extent(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert split_extent(2, 3) == [(0, 1), (1, 1), (2, 0)]
    assert split_box((10, 6), 1, 4, 3) == Box((0, 5), (10, 1))


def test_layout_json_round_trip_and_hash() -> None:
    layout = trainer_layout(dense_model(), tp=2, pp=3)
    data = json.loads(json.dumps(layout.to_json()))
    again = Layout.from_json(data)
    assert again == layout and again.hash() == layout.hash()


def test_layout_from_rank_records_matches_per_parameter_view() -> None:
    layout = trainer_layout(dense_model(), tp=2, pp=2)
    records = [layout.rank_shards(r) for r in layout.ranks]
    assert Layout.from_ranks(reversed(records)) == layout


def test_layout_rejects_ranks_disagreeing_on_shape() -> None:
    records = [
        RankShards.of(0, [TensorShard("w", (4, 4), "bfloat16", Box((0, 0), (2, 4)))]),
        RankShards.of(1, [TensorShard("w", (4, 5), "bfloat16", Box((2, 0), (2, 4)))]),
    ]
    with pytest.raises(ShardError, match=r"^w: ranks disagree on the global shape"):
        Layout.from_ranks(records)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"name": "a.w", "shape": [4], "dtype": "bfloat16", "shards": [[0, [2], [3]]]}, r"a\.w: .*outside"),
        (
            {"name": "a.w", "shape": [4], "dtype": "bfloat16", "shards": [[0, [0], [4]], [0, [0], [4]]]},
            r"a\.w: .*more than one",
        ),
        ({"name": "a.w", "shape": [4], "dtype": "bfloat17", "shards": []}, r"a\.w: .*unsupported dtype"),
        ({"name": "a.w", "shape": [4], "dtype": "bfloat16", "shards": [[0, [0, 0], [4]]]}, r"a\.w: "),
        ({"name": "a.w", "shape": [4], "dtype": "bfloat16", "shards": [[0, [-1], [4]]]}, r"a\.w: .*negative"),
        ({"name": "a.w", "shape": [4], "dtype": "bfloat16"}, r"a\.w: malformed"),
    ],
)
def test_malformed_parameter_metadata_names_the_parameter(data: dict, pattern: str) -> None:
    with pytest.raises(ShardError, match=pattern):
        Layout.from_json({"schema": 1, "params": [data]})


# --- plans ---------------------------------------------------------------------------------------------


def test_column_sharded_worked_example_tp2_to_tp4() -> None:
    """runtime_anchors A.6: down_proj [4096, 11008] split on dim 1, train TP2 -> infer TP4."""
    shape = (4096, 11008)
    senders = Layout.of([param("down", shape, [(r, split_box(shape, 1, 2, r)) for r in range(2)])])
    receivers = Layout.of([param("down", shape, [(4 + r, split_box(shape, 1, 4, r)) for r in range(4)])])
    plan = build_plan(senders, receivers)
    assert [(t.src, t.dst) for t in plan.transfers] == [(0, 4), (0, 5), (1, 6), (1, 7)]
    t = plan.transfers[1]
    assert t.src_box == Box((0, 2752), (4096, 2752))  # a non-contiguous block of the sender's shard
    assert t.dst_box == Box((0, 0), (4096, 2752))  # the whole receiver shard
    assert plan.received_bytes() == {r: 4096 * 2752 * 2 for r in range(4, 8)}


@pytest.mark.parametrize(
    ("trainer", "inference"),
    [
        ({"tp": 2, "pp": 4}, {"tp": 4, "ranks": range(8)}),  # TP2 x PP4 -> TP4 x DP2, colocated
        ({"tp": 2, "pp": 4}, {"tp": 4, "ranks": range(8, 12)}),  # disjoint: 12 ranks
        ({"tp": 4}, {"tp": 1, "ranks": [0]}),
        ({"tp": 2, "pp": 3}, {"tp": 3, "ranks": range(6)}),  # world 6, uneven splits
        ({"tp": 3, "pp": 2, "dp": 2}, {"tp": 5, "ranks": range(2, 12)}),  # odd degrees, replicas
    ],
)
def test_dense_reshards_cover_every_receiver_element_once(trainer: dict, inference: dict) -> None:
    model = dense_model()
    senders, receivers = trainer_layout(model, **trainer), inference_layout(model, **inference)
    plan = build_plan(senders, receivers)
    assert_exact_cover(plan, senders, receivers)


def test_expert_reshard_ep8_to_ep2_balances_replicated_sources() -> None:
    model = moe_model(layers=4)
    senders = trainer_layout(model, ep=8, dp=8)
    receivers = inference_layout(model, ep=2, ranks=range(8, 12))  # disjoint, so nothing is local
    plan = build_plan(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    # Experts come from their single owner; each replicated tensor from one of 8 holders, spread evenly.
    expert = [t for t in plan.transfers if "experts" in t.name]
    assert {t.src for t in expert if t.name == "layers.0.experts.w13" and t.dst == 8} == {0, 1, 2, 3}
    replicated = [t for t in plan.transfers if "experts" not in t.name]
    per_sender: dict[int, int] = {}
    for t in replicated:
        per_sender[t.src] = per_sender.get(t.src, 0) + t.wire_bytes
    biggest = max(t.wire_bytes for t in replicated)
    assert len(per_sender) == 8 and max(per_sender.values()) - min(per_sender.values()) <= biggest


def test_receiver_holding_a_replica_copies_locally() -> None:
    shape = (6, 4)
    senders = Layout.of([param("norm", shape, [(r, Box.full(shape)) for r in range(4)])])
    receivers = Layout.of([param("norm", shape, [(r, split_box(shape, 0, 2, r % 2)) for r in range(1, 5)])])
    plan = build_plan(senders, receivers)
    assert [(t.src, t.dst) for t in plan.transfers if t.dst < 4] == [(1, 1), (2, 2), (3, 3)]
    assert [t.src for t in plan.transfers if t.dst == 4] == [0]  # least loaded, nearest on the ring


def test_plan_is_deterministic_and_hash_survives_json() -> None:
    model = dense_model()
    senders, receivers = (
        trainer_layout(model, tp=2, pp=2, dp=2),
        inference_layout(model, tp=3, ranks=range(6)),
    )
    plan = build_plan(senders, receivers)
    shuffled = list(senders.params)
    random.Random(7).shuffle(shuffled)
    again = build_plan(Layout.of(shuffled), Layout.from_json(json.loads(json.dumps(receivers.to_json()))))
    assert again.hash() == plan.hash()
    assert TransferPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    other = inference_layout(model, tp=2, ranks=range(6))
    assert build_plan(senders, other).hash() != plan.hash()


def test_plan_errors_name_the_parameter() -> None:
    shape = (8, 4)
    halves = [(0, split_box(shape, 0, 2, 0)), (1, split_box(shape, 0, 2, 1))]
    full = Layout.of([param("blk.w", shape, [(2, Box.full(shape))])])

    gap = Layout.of([param("blk.w", shape, [(0, Box((0, 0), (3, 4))), (1, Box((4, 0), (4, 4)))])])
    with pytest.raises(PlanError, match=r"^blk\.w: gap: receiver rank 2 .*4 of 32 elements.*\[3, 0\]"):
        build_plan(gap, full)

    overlap = Layout.of([param("blk.w", shape, [(0, Box((0, 0), (5, 4))), (1, Box((4, 0), (4, 4)))])])
    with pytest.raises(PlanError, match=r"^blk\.w: overlap: sender box .*ranks \[0\].*ranks \[1\]"):
        build_plan(overlap, full)

    # Receivers: identical boxes are replicas (each filled), a partial overlap is a description error.
    overlapping_receivers = Layout.of(
        [
            param(
                "blk.w", shape, [(2, Box((0, 0), (6, 4))), (3, Box((5, 0), (3, 4))), (4, Box((0, 0), (6, 4)))]
            )
        ]
    )
    with pytest.raises(PlanError, match=r"^blk\.w: overlap: receiver box .*ranks \[2, 4\].*ranks \[3\]"):
        build_plan(Layout.of([param("blk.w", shape, halves)]), overlapping_receivers)
    replicas = Layout.of([param("blk.w", shape, [(2, Box.full(shape)), (3, Box.full(shape))])])
    halved = Layout.of([param("blk.w", shape, halves)])
    assert_exact_cover(build_plan(halved, replicas), halved, replicas)

    with pytest.raises(PlanError, match=r"^blk\.w: shape mismatch"):
        build_plan(Layout.of([param("blk.w", (8, 5), [(0, Box.full((8, 5)))])]), full)

    with pytest.raises(PlanError, match=r"^blk\.w: dtype mismatch: senders hold int32"):
        build_plan(Layout.of([param("blk.w", shape, halves, dtype="int32")]), full)

    with pytest.raises(PlanError, match=r"^blk\.w: the receivers need it but no sender holds it"):
        build_plan(Layout.of([param("other", shape, halves)]), full)


def test_float_casts_are_planned_with_receiver_wire_size() -> None:
    shape = (4, 4)
    senders = Layout.of([param("router", shape, [(0, Box.full(shape))], dtype="bfloat16")])
    receivers = Layout.of([param("router", shape, [(1, Box.full(shape))], dtype="float32")])
    (t,) = build_plan(senders, receivers).transfers
    assert (t.src_dtype, t.dst_dtype, t.wire_bytes) == ("bfloat16", "float32", 64)


@st.composite
def reshard_cases(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """Random grids on both sides, sender grids replicated on several ranks, receivers possibly colocated."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))

    def grid(prefix_rank: int, replicas: int) -> list[tuple[int, Box]]:
        cuts = [draw(st.integers(1, n)) for n in shape]
        cells = list(itertools.product(*[split_extent(n, k) for n, k in zip(shape, cuts, strict=True)]))
        boxes = [Box(tuple(o for o, _ in c), tuple(n for _, n in c)) for c in cells]
        out, rank = [], prefix_rank
        for _ in range(replicas):
            for b in boxes:
                out.append((rank, b))
                rank += 1
        return out

    senders = grid(0, draw(st.integers(1, 3)))
    receivers = grid(draw(st.integers(0, len(senders))), draw(st.integers(1, 2)))
    dtypes = ("bfloat16", draw(st.sampled_from(["bfloat16", "float32"])))
    return (
        Layout.of([param("p", shape, senders, dtypes[0])]),
        Layout.of([param("p", shape, receivers, dtypes[1])]),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_random_reshards_cover_exactly_once(case: tuple[Layout, Layout]) -> None:
    senders, receivers = case
    plan = build_plan(senders, receivers)
    assert_exact_cover(plan, senders, receivers)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases(), st.integers(ALIGN, 400), st.integers(2, 7))
def test_chunks_respect_the_budget_and_tile_every_transfer(
    case: tuple[Layout, Layout], capacity: int, world_extra: int
) -> None:
    senders, receivers = case
    plan = build_plan(senders, receivers)
    chunk_plan = assign_chunks(plan, capacity)
    cap = capacity // ALIGN * ALIGN
    for c in range(chunk_plan.n_chunks):
        assert all(v <= cap for v in chunk_plan.usage(c).values())
        assert chunk_plan.chunks[c], "no chunk is empty for everyone"
    # Pieces tile the remote transfers: same elements, nothing twice.
    pieces = [t for c in chunk_plan.chunks for t in c]
    remote = [t for t in plan.transfers if not t.is_local]
    assert sum(t.numel for t in pieces) == sum(t.numel for t in remote)
    assert_exact_cover(
        TransferPlan(tuple(pieces) + chunk_plan.local, plan.min_world_size), senders, receivers
    )
    # Both ends of every pair see the same slices at the same offsets, and packed buffers fit the budget.
    world = plan.min_world_size + world_extra
    schedules = [rank_schedule(chunk_plan, r, world) for r in range(world)]
    for s in schedules:
        for chunk in s.chunks:
            assert chunk.staging_bound <= cap
            assert [b.round for b in chunk.batches] == sorted(b.round for b in chunk.batches)
            for b in chunk.batches:
                mirror = next(x for x in schedules[b.peer].chunks[chunk.index].batches if x.peer == s.rank)
                assert (mirror.sends, mirror.recvs) == (b.recvs, b.sends)
                assert mirror.round == b.round
                assert all(x.offset % ALIGN == 0 for m in b.sends + b.recvs for x in m.slices)


def test_budget_smaller_than_one_tensor_splits_into_slabs() -> None:
    t = Transfer("w", 0, 1, Box((2, 0, 0), (5, 3, 8)), (0, 0, 0), (2, 0, 0), "bfloat16", "float32")
    pieces = split_transfer(t, 64)  # one row of 8 fp32 is 32 B: two rows per piece
    assert all(aligned(p.wire_bytes) <= 64 for p in pieces)
    assert sum(p.numel for p in pieces) == t.numel
    assert pieces[0].region == Box((2, 0, 0), (1, 2, 8))
    assert split_transfer(t, 10_000) == [t]
    with pytest.raises(PlanError, match=r"^w: a chunk budget of 8 B"):
        split_transfer(t, 8)


def test_chunk_count_follows_the_busiest_rank() -> None:
    """Rank 0 receives 4 x 1 KiB from four peers; with a 2 KiB chunk it needs two chunk rounds."""
    shape = (4, 256)
    senders = Layout.of(
        [param("w", shape, [(r, split_box(shape, 0, 4, r - 1)) for r in range(1, 5)], "float32")]
    )
    receivers = Layout.of([param("w", shape, [(0, Box.full(shape))], "float32")])
    chunk_plan = assign_chunks(build_plan(senders, receivers), 2048)
    assert chunk_plan.n_chunks == 2 and [len(c) for c in chunk_plan.chunks] == [2, 2]


# --- the peer schedule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world", list(range(1, 34)))
def test_circle_schedule_meets_every_pair_exactly_once(world: int) -> None:
    met: set[tuple[int, int]] = set()
    for r in range(num_rounds(world)):
        partners = [partner(i, r, world) for i in range(world)]
        for i, p in enumerate(partners):
            if p is None:
                continue
            assert partners[p] == i, "pairing must be symmetric"
            assert meeting_round(i, p, world) == r
            if i < p:
                assert (i, p) not in met
                met.add((i, p))
        assert sum(p is None for p in partners) == world % 2
    assert len(met) == world * (world - 1) // 2


# --- configuration -------------------------------------------------------------------------------------


def test_config_from_env() -> None:
    env = {
        "COLOCATE_P2P_BUDGET_MB": "64",
        "COLOCATE_P2P_TRACE": "1",
        "COLOCATE_P2P_TIMEOUT_S": "5",
        "COLOCATE_P2P_PIPELINE_DEPTH": "1",
    }
    config = ExecutorConfig.from_env(env)
    assert config == ExecutorConfig(budget_bytes=64 << 20, pipeline_depth=1, timeout_s=5.0, trace=True)
    assert ExecutorConfig.from_env({}) == ExecutorConfig()
    assert ExecutorConfig().budget_bytes == 1 << 30
    with pytest.raises(ValueError, match="COLOCATE_P2P_TRACE"):
        ExecutorConfig.from_env({"COLOCATE_P2P_TRACE": "maybe"})
    with pytest.raises(ValueError, match="budget_bytes"):
        ExecutorConfig(budget_bytes=8)


def test_large_slices_get_messages_of_their_own_and_small_ones_are_packed() -> None:
    shape = (64, 64)  # bf16 rows of 128 B
    senders = Layout.of([param("w", shape, [(0, Box.full(shape))]), param("n", (8,), [(0, Box.full((8,)))])])
    receivers = Layout.of(
        [
            param("w", shape, [(1, split_box(shape, 0, 4, 0)), (2, split_box(shape, 0, 4, 1))]),
            param("n", (8,), [(1, Box.full((8,)))]),
        ]
    )
    chunk_plan = assign_chunks(build_plan(senders, receivers), 1 << 20)
    (chunk,) = rank_schedule(chunk_plan, 0, 3, direct_min_bytes=1024).chunks
    to_1 = next(b for b in chunk.batches if b.peer == 1)
    assert [[p.transfer.name for p in m.slices] for m in to_1.sends] == [["n"], ["w"]]
    assert [m.nbytes for m in to_1.sends] == [16, 16 * 64 * 2]
    (packed_only,) = rank_schedule(chunk_plan, 0, 3, direct_min_bytes=1 << 30).chunks
    (message,) = next(b for b in packed_only.batches if b.peer == 1).sends
    assert [(p.transfer.name, p.offset) for p in message.slices] == [("n", 0), ("w", 16)]


def test_dense_boxes_are_single_runs_of_row_major_memory() -> None:
    from colocate_runtime.p2p.binding import is_dense_in  # re-exported from chunks

    shape = (4, 6, 8)
    assert is_dense_in(Box((1, 0, 0), (2, 6, 8)), shape)  # whole rows of the outer dim
    assert is_dense_in(Box((1, 2, 0), (1, 3, 8)), shape)  # a run inside one outer index
    assert is_dense_in(Box((1, 2, 3), (1, 1, 4)), shape)
    assert not is_dense_in(Box((0, 0, 0), (4, 3, 8)), shape)  # half of every outer index
    assert not is_dense_in(Box((1, 2, 0), (2, 3, 8)), shape)
    assert is_dense_in(Box((), ()), ())


def test_chunks_take_the_whole_budget_only_when_little_is_staged() -> None:
    """Rows move in place (dense at both ends, one dtype): whole-budget chunks, half the rounds. Columns are
    strided at both ends and small pieces are packed: chunks of budget / depth, as the staging needs."""
    shape = (64, 64)  # bf16 rows of 128 B, 8 KiB in all
    rows = Layout.of([param("w", shape, [(0, Box.full(shape))])])
    moved = Layout.of([param("w", shape, [(1, Box.full(shape))])])
    plan = build_plan(rows, moved)
    shards = shard_shapes(rows, moved)
    assert staged_peak(assign_chunks(plan, 2048), shards, direct_min_bytes=64) == 0
    assert plan_chunks(plan, 2048, 2, shards, direct_min_bytes=64).capacity == 2048
    assert plan_chunks(plan, 2048, 2, shards, direct_min_bytes=1 << 20).capacity == 1024  # all packed
    columns = Layout.of([param("w", shape, [(0, split_box(shape, 1, 2, 0)), (1, split_box(shape, 1, 2, 1))])])
    on_2 = Layout.of([param("w", shape, [(2, Box.full(shape))])])
    plan = build_plan(columns, on_2)
    shards = shard_shapes(columns, on_2)
    assert staged_peak(assign_chunks(plan, 2048), shards, direct_min_bytes=64) > 1024
    assert plan_chunks(plan, 2048, 2, shards, direct_min_bytes=64).capacity == 1024


def test_the_first_parameter_whose_layout_differs_is_named_with_the_ranks() -> None:
    model = dense_model(layers=2)
    senders = trainer_layout(model, tp=3)
    one, three = (inference_layout(model, tp=tp, ranks=range(3)) for tp in (1, 3))
    fp_one, fp_three = (
        fingerprint(senders, one, build_plan(senders, one)),
        fingerprint(senders, three, build_plan(senders, three)),
    )
    assert json.loads(json.dumps(fp_one)) == fp_one  # plain data: it crosses the wire as JSON
    diff = first_difference([fp_one, fp_one, fp_three])
    expected = next(p.name for p in one.params if p != three.by_name()[p.name])
    assert diff.name == expected and diff.part == "receiver shards"
    assert re.match(
        rf"^{re.escape(expected)}: its receiver shards differ between ranks \(ranks \[0, 1\] "
        r"have \w+; ranks \[2\] have \w+\)$",
        diff.text,
    ), diff.text
    # A parameter only some ranks describe is named as such; equal fingerprints name nothing.
    extra = Layout.of([*senders.params, param("zz.extra", (4,), [(0, Box.full((4,)))])])
    extra_recv = Layout.of([*one.params, param("zz.extra", (4,), [(1, Box.full((4,)))])])
    fp_extra = fingerprint(extra, extra_recv, build_plan(extra, extra_recv))
    diff = first_difference([fp_one, fp_extra, fp_one])
    assert diff.name == "zz.extra" and "ranks [0, 2] do not describe it; ranks [1] have" in diff.text
    assert first_difference([fp_one, fp_one]).name is None
    assert describe_shards(one.by_name()[expected]).startswith("0:[0")
