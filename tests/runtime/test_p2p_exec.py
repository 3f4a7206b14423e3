"""The executor in real multi-process worlds: gloo on the CPU here, NCCL on two GPUs where present.

Every received tensor is compared bitwise with the reference; staging is checked against the budget; ranks
that misbehave (bad metadata, different plans, wrong tensors, a stalled peer) make every rank raise instead
of hanging.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import pytest
import torch

from colocate_runtime.p2p.binding import SOURCE, TARGET, LocalTensors
from colocate_runtime.shards import ShardError
from tests.runtime.p2p_helpers import (
    ROW,
    Scenario,
    WorldResult,
    bad_metadata_worker,
    bad_tensor_worker,
    dense_model,
    extra_param_worker,
    inference_layout,
    mismatch_worker,
    moe_model,
    reshard_worker,
    run_world,
    stall_worker,
)


def check_reshard(result: WorldResult, scenario: Scenario) -> list[dict[str, Any]]:
    assert not result.errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(result.errors.items()))
    reports = result.results
    assert len({r["plan_hash"] for r in reports}) == 1, "ranks built different plans"
    assert len({r["n_chunks"] for r in reports}) == 1, "ranks walked different chunk counts"
    for rank, r in enumerate(reports):
        assert r["mismatches"] == [[]] * scenario.runs, f"rank {rank}: wrong data in {r['mismatches']}"
        assert r["sources_touched"] == [], f"rank {rank}: sources modified: {r['sources_touched']}"
        budget = (scenario.budget_by_rank or {}).get(rank, scenario.budget_bytes)
        assert max(r["staging_bytes"]) <= budget, f"rank {rank}: staging {r['staging_bytes']} > {budget}"
        assert (r["bytes_sent"], r["bytes_received"]) == (r["expected_sent"], r["expected_received"])
        assert r["received_in_place"] + r["received_staged"] == r["bytes_received"], f"rank {rank}: {r}"
        assert r["sent_in_place"] + r["sent_staged"] == r["bytes_sent"], f"rank {rank}: {r}"
    assert sum(r["bytes_sent"] for r in reports) == sum(r["bytes_received"] for r in reports)
    for rank, r in enumerate(reports):
        # On CUDA the allocator's own peak is checked too: the arena plus a few 512 B control tensors.
        budget = (scenario.budget_by_rank or {}).get(rank, scenario.budget_bytes)
        assert all(x <= budget + 4096 for x in r["cuda_extra_bytes"]), f"rank {rank}: {r['cuda_extra_bytes']}"
    return reports


# --- asymmetric reshards on gloo -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_tp2_pp4_to_tp4_colocated_on_8_ranks() -> None:
    """Every rank holds a trainer shard (TP2 x PP4) and an inference shard (TP4, two replicas)."""
    scenario = Scenario(dense_model(), {"tp": 2, "pp": 4}, {"tp": 4, "ranks": range(8)}, runs=2)
    reports = check_reshard(run_world(reshard_worker, 8, scenario), scenario)
    assert all(r["bytes_local"] > 0 for r in reports)  # colocated: part of each shard never leaves the GPU


@pytest.mark.timeout(90)
def test_tp2_pp4_to_tp4_disjoint_world_of_12_with_fp32_norms_and_strided_targets() -> None:
    scenario = Scenario(
        dense_model(),
        {"tp": 2, "pp": 4},
        {"tp": 4, "ranks": range(8, 12), "dtype_overrides": {"norm": "float32"}},
        budget_bytes=4096,
        strided_targets=True,
        direct_min_bytes=200,  # larger slices get messages of their own, dense ones move in place
    )
    reports = check_reshard(run_world(reshard_worker, 12, scenario, timeout=80), scenario)
    assert reports[0]["n_chunks"] >= 2
    assert sum(r["messages"] for r in reports) > sum(r["batches_total"] for r in reports)
    assert all(r["bytes_received"] == 0 for r in reports[:8]) and all(
        r["bytes_sent"] == 0 for r in reports[8:]
    )


@pytest.mark.timeout(60)
def test_tp4_to_tp1_bf16_senders_into_fp32_receiver_from_strided_sources() -> None:
    scenario = Scenario(
        dense_model(),
        {"tp": 4},
        {"tp": 1, "ranks": [0], "dtype": "float32"},
        strided_sources=True,
        direct_min_bytes=64,  # column slabs arrive as messages of their own into dense targets
    )
    reports = check_reshard(run_world(reshard_worker, 4, scenario), scenario)
    assert reports[0]["bytes_received"] > 0 and all(r["bytes_received"] == 0 for r in reports[1:])


@pytest.mark.timeout(90)
def test_ep8_to_ep2_with_replicated_dense_params_and_fp32_router() -> None:
    scenario = Scenario(
        moe_model(),
        {"ep": 8, "dp": 8},
        {"ep": 2, "ranks": range(8), "dtype_overrides": {"router": "float32"}},
        budget_bytes=2048,
        direct_min_bytes=100,
    )
    reports = check_reshard(run_world(reshard_worker, 8, scenario), scenario)
    assert reports[0]["n_chunks"] >= 2
    # Replicated tensors are fetched from several holders, not all from rank 0.
    assert sum(r["bytes_sent"] > 0 for r in reports) == 8


@pytest.mark.timeout(60)
def test_world_of_6_uneven_tp2_pp3_to_tp3_strided_both_sides_depth_1() -> None:
    scenario = Scenario(
        dense_model(layers=5, hidden=11, ffn=13, vocab=29),
        {"tp": 2, "pp": 3},
        {"tp": 3, "ranks": range(6)},
        budget_bytes=1500,
        pipeline_depth=1,
        strided_sources=True,
        strided_targets=True,
    )
    check_reshard(run_world(reshard_worker, 6, scenario), scenario)


def test_local_tensors_are_checked_and_the_program_signature_found_in_one_pass() -> None:
    cpu = torch.device("cpu")
    specs = {
        SOURCE: (
            ("a", (4, 6), torch.float32, True),
            ("b", (3,), torch.bfloat16, False),
            ("c", (2, 2), torch.float32, True),
        ),
        TARGET: (),
    }
    good = {
        "a": torch.zeros(8, 6)[::2],
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "c": torch.zeros(2, 2),
        "unused": torch.zeros(1),
    }
    bound = LocalTensors(0, cpu, specs, {SOURCE: good, TARGET: {}})
    assert bound.signature == (False, True)  # which tensors of movable messages are dense: a no, c yes
    assert all(bound.tensors(SOURCE)[n] is good[n] for n in "abc")
    for change, message in (
        ({"b": None}, "b: rank 0 has no local source tensor for it"),
        ({"c": torch.zeros(2, 3)}, "c: the local source on rank 0 has shape (2, 3), its shard is [2, 2]"),
        ({"b": torch.zeros(3)}, "b: the local source on rank 0 is torch.float32, expected torch.bfloat16"),
        ({"a": torch.empty(4, 6, device="meta")}, "a: the local source on rank 0 is on meta"),
    ):
        bad = {n: t for n, t in {**good, **change}.items() if t is not None}
        with pytest.raises(ShardError, match=re.escape(message)):
            LocalTensors(0, cpu, specs, {SOURCE: bad, TARGET: {}})


@pytest.mark.timeout(60)
def test_budget_smaller_than_one_tensor() -> None:
    """A 96 B budget (48 B per chunk at depth 2) against fp32 tensors of up to ~1.2 KiB: tensors are cut
    into slabs, dozens of chunk rounds run, staging never exceeds the budget."""
    scenario = Scenario(
        dense_model(layers=1),
        {"tp": 3},
        {"tp": 1, "ranks": [0, 2], "dtype": "float32"},
        budget_bytes=96,
        strided_targets=True,
        direct_min_bytes=32,
    )
    reports = check_reshard(run_world(reshard_worker, 3, scenario), scenario)
    assert reports[0]["n_chunks"] > 40
    assert max(max(r["staging_bytes"]) for r in reports) > 0  # the packed path really ran


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strided", [False, True])
def test_in_place_plan_takes_whole_budget_chunks_and_stays_within_the_budget(strided: bool) -> None:
    """Dense slices in one dtype move in place, so chunks take the whole budget; targets that turn out
    strided at run time need staging after all: the pipeline gets shallower, staging stays in the budget."""
    scenario = Scenario(
        dense_model(layers=2),
        {"tp": 1},
        {"tp": 1, "ranks": [1]},
        budget_bytes=2048,
        direct_min_bytes=16,
        strided_targets=strided,
        runs=2,
    )
    reports = check_reshard(run_world(reshard_worker, 2, scenario), scenario)
    assert {r["capacity"] for r in reports} == {2048}
    assert reports[0]["n_chunks"] >= 2
    if strided:
        assert max(reports[1]["staging_bytes"]) > 2048 // 2  # more than one slot of budget / depth


@pytest.mark.timeout(60)
def test_contiguous_received_slices_land_in_the_targets_with_no_staging_and_every_bit_kept() -> None:
    """Trainer TP1 on rank 0, inference TP2 on ranks 1 and 2: each received slice is a whole shard or a row
    range of one, so it is received straight into the target. Random bit patterns, NaN payloads included,
    arrive as they were sent; the sender packs its column slices (staged on its side only)."""
    scenario = Scenario(
        dense_model(layers=2),
        {"tp": 1},
        {"tp": 2, "ranks": [1, 2]},
        budget_bytes=4096,  # several chunks; slabs of a row range are row ranges too
        direct_min_bytes=16,  # every slice a message of its own
        bits=True,
        runs=2,
    )
    reports = check_reshard(run_world(reshard_worker, 3, scenario), scenario)
    assert reports[0]["n_chunks"] >= 2
    for rank in (1, 2):
        r = reports[rank]
        assert r["bytes_received"] > 0 and r["received_in_place"] == r["bytes_received"], r
        assert r["received_staged"] == 0 and r["staging_bytes"] == [0, 0], r
    assert reports[0]["sent_staged"] > 0  # row-parallel weights leave rank 0 as column slices: packed


@pytest.mark.timeout(60)
def test_a_mixed_plan_stages_only_the_slices_that_are_not_one_dense_run_of_their_target() -> None:
    """Trainer TP2 on ranks 0 and 1, inference TP1 on rank 2: column-parallel slices are row ranges of the
    target (in place), row-parallel ones column ranges (strided: staged, then unpacked)."""
    model = dense_model(layers=2)
    scenario = Scenario(
        model, {"tp": 2}, {"tp": 1, "ranks": [2]}, budget_bytes=1 << 20, direct_min_bytes=16, bits=True
    )
    reports = check_reshard(run_world(reshard_worker, 3, scenario), scenario)
    r = reports[2]
    columns = sum(2 * math.prod(p.shape) for p in model.params if p.kind == ROW)  # bf16
    assert r["received_staged"] == columns and r["received_in_place"] == r["bytes_received"] - columns, r
    assert 0 < r["staging_bytes"][0] < r["bytes_received"]


@pytest.mark.timeout(60)
def test_ranks_configured_with_different_budgets_agree_on_the_smallest() -> None:
    scenario = Scenario(
        dense_model(layers=2),
        {"tp": 2},
        {"tp": 3, "ranks": [0, 1, 2]},
        budget_bytes=1 << 20,
        budget_by_rank={1: 512},
    )
    reports = check_reshard(run_world(reshard_worker, 3, scenario), scenario)
    assert {r["capacity"] for r in reports} == {256}


@pytest.mark.timeout(60)
def test_trace_switch_records_every_peer_batch() -> None:
    scenario = Scenario(
        dense_model(layers=1), {"tp": 3}, {"tp": 1, "ranks": [0, 1, 2]}, budget_bytes=2048, trace=True
    )
    reports = check_reshard(run_world(reshard_worker, 3, scenario), scenario)
    for rank, r in enumerate(reports):
        events = r["trace"]
        enqueued = [e[:3] for e in events if e[3] == "enqueued"]
        drained = [e[:3] for e in events if e[3] == "drained"]
        assert enqueued and sorted(enqueued) == sorted(drained), f"rank {rank}: {events}"
        assert {peer for _, _, peer in enqueued} == {0, 1, 2} - {rank}


# --- failures become errors on every rank, never hangs -------------------------------------------------


@pytest.mark.timeout(60)
def test_stalled_peer_becomes_a_timeout_naming_it() -> None:
    started = time.monotonic()
    result = run_world(stall_worker, 3, 2, 6.0, timeout=40)
    assert time.monotonic() - started < 30
    for rank in (0, 1):
        error = result.errors.get(rank, "")
        assert error.startswith("PeerTimeoutError"), f"rank {rank}: {error or result.results[rank]}"
        assert "waiting on peer 2" in error
    assert result.results[2] is not None and 2 not in result.errors


@pytest.mark.timeout(60)
def test_malformed_metadata_on_one_rank_fails_every_rank() -> None:
    result = run_world(bad_metadata_worker, 3, 1)
    assert set(result.errors) == {0, 1, 2}, result.results
    assert "layers.1.mlp.up.weight: gap" in result.errors[1]
    for rank in (0, 2):
        assert "could not be built on rank(s) [1]" in result.errors[rank]


@pytest.mark.timeout(60)
def test_ranks_with_different_plans_refuse_to_start() -> None:
    result = run_world(mismatch_worker, 3, 2)
    assert set(result.errors) == {0, 1, 2}, result.results
    assert all(e.startswith("PlanMismatchError") and "ranks [0, 1]" in e for e in result.errors.values())
    # Every rank names the first parameter whose layout differs and who holds what, not only plan hashes.
    model = dense_model(layers=2)
    one, three = (inference_layout(model, tp=tp, ranks=range(3)) for tp in (1, 3))
    first = next(p.name for p in one.params if p != three.by_name()[p.name])
    for rank, error in result.errors.items():
        assert re.search(
            rf"first difference: {re.escape(first)}: its receiver shards differ between ranks "
            r"\(ranks \[0, 1\] have \w+; ranks \[2\] have \w+\); on this rank its receivers are \d+:",
            error,
        ), f"rank {rank}: {error}"


@pytest.mark.timeout(60)
def test_a_parameter_only_one_rank_describes_is_named_on_every_rank() -> None:
    result = run_world(extra_param_worker, 3, 1)
    assert set(result.errors) == {0, 1, 2}, result.results
    for rank, error in result.errors.items():
        assert error.startswith("PlanMismatchError"), f"rank {rank}: {error}"
        assert (
            "first difference: zz.extra.bias: its sender shards differ between ranks (ranks [0, 2] do not "
            "describe it; ranks [1] have" in error
        ), f"rank {rank}: {error}"


@pytest.mark.timeout(60)
def test_wrong_local_tensor_on_one_rank_fails_every_rank_before_sending() -> None:
    result = run_world(bad_tensor_worker, 3, 0)
    assert not result.errors, result.errors
    errors = {rank: error for rank, (error, _) in enumerate(result.results)}
    assert "layers.0.attn.o.weight: the local target on rank 0 has shape" in errors[0]
    for rank in (1, 2):
        assert "rank(s) [0] rejected their local tensors" in errors[rank]
    # The vote comes before any receive, in place or staged, and before the local copies: no target changed.
    assert [written for _, written in result.results] == [[], [], []]


# --- NCCL on two GPUs ----------------------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(180)
def test_gpu_all_to_all_reshard_tp2_rows_to_tp2_replicas_fp32_strided() -> None:
    """Both GPUs send and receive at once (colocated), bf16 into fp32 norms, strided targets, many chunks."""
    scenario = Scenario(
        dense_model(layers=4, hidden=256, ffn=688, vocab=1000, heads=8),
        {"tp": 2},
        {"tp": 1, "ranks": [0, 1], "dtype_overrides": {"norm": "float32"}},
        budget_bytes=256 << 10,
        strided_targets=True,
        runs=2,
        direct_min_bytes=16 << 10,
    )
    reports = check_reshard(run_world(reshard_worker, 2, scenario, backend="nccl", timeout=150), scenario)
    assert reports[0]["n_chunks"] >= 4


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(180)
def test_gpu_move_everything_from_gpu0_to_gpu1_with_budget_below_one_tensor() -> None:
    scenario = Scenario(
        dense_model(layers=2, hidden=512, ffn=1376, vocab=2000, heads=8),
        {"tp": 1},
        {"tp": 1, "ranks": [1], "dtype": "float32"},
        budget_bytes=1 << 20,
        strided_sources=True,
    )
    reports = check_reshard(run_world(reshard_worker, 2, scenario, backend="nccl", timeout=150), scenario)
    assert reports[1]["n_chunks"] > 8


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(120)
def test_gpu_stalled_peer_becomes_a_timeout_naming_it() -> None:
    result = run_world(stall_worker, 2, 1, 8.0, backend="nccl", timeout=60)
    error = result.errors.get(0, "")
    assert error.startswith("PeerTimeoutError") and "waiting on peer 1" in error, error or result.results
