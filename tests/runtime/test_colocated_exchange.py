"""The colocated update when the inference layout differs from the trainer's: each rank (one per GPU) runs
its GPU's writer and a reader whose targets need slices published on other GPUs, exchanged through
runtime/p2p (gloo and shared memory here; NCCL and CUDA IPC on two GPUs), through a real Redis.

Every target is compared bitwise with the reference after every step; the local copy and the exchange
together move each target byte exactly once; one rank's failure makes every rank raise within a bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.exchange_seam import ExchangeRequest
from colocate_runtime.colocated.outcome import StepFailed, StepRejected, StepTimedOut
from colocate_runtime.colocated.wiring import new_reader, new_writer
from colocate_runtime.colocated.writer import PendingStep, WeightWriter
from colocate_runtime.p2p.layout import Layout
from tests.runtime.exchange_helpers import (
    TP2_PARAMS,
    TP3_PARAMS,
    Case,
    Param,
    rank_worker,
    trainer_step,
    writers_case,
)
from tests.runtime.p2p_helpers import WorldResult, run_world

REPO = Path(__file__).resolve().parents[2]


def records(result: WorldResult) -> list[list[dict[str, Any]]]:
    assert not result.errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(result.errors.items()))
    return result.results


def assert_all_good(step: dict[str, Any], rank: int) -> None:
    where = f"rank {rank} step {step['step']}"
    assert step.get("ok"), f"{where}: {step.get('error')}"
    assert step["wrong"] == [], f"{where}: wrong data in {step['wrong']}"
    # Each target byte moved once: copied from this GPU's buckets or received, never both.
    assert step["copied_locally"] + step["received"] == step["target_bytes"], where
    assert step["p2p_local"] == 0, where
    assert step.get("writer", "ok") == "ok", f"{where}: {step.get('writer')}"


@pytest.fixture
def case_args(redis_server: RedisServer, tmp_path: Path) -> dict[str, Any]:
    return {
        "redis": MetaStoreAddress(redis_server.host, redis_server.port, redis_server.password),
        "shm_dir": str(tmp_path / "shm"),
    }


class RecordingExchange:
    """Stands in for a collective exchange: records calls and abandons; fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.abandoned: list[str] = []
        self.fail = fail

    def __call__(self, request: ExchangeRequest) -> set[str]:
        self.calls.append(request.manifest.step)
        if self.fail:
            raise StepFailed("the peers said no", step=request.manifest.step)
        return set(request.missing)

    def abandon(self, error: BaseException) -> None:
        self.abandoned.append(type(error).__name__)


@pytest.mark.timeout(30)
def test_the_reader_takes_part_in_the_exchange_exactly_once_per_step(case_args: dict) -> None:
    """Called on every step, also with nothing missing (a rank that mostly sends); abandoned once when the
    step fails before it; never abandoned after it was called."""
    case = Case(TP2_PARAMS, **case_args)
    cfg = case.config()
    trainer, _ = case.layouts(1)
    embed = torch.empty(11, 6, dtype=torch.bfloat16)  # the only target: the other entries are for peers
    exchange = RecordingExchange()
    writer, reader = new_writer(cfg), new_reader(cfg, {"embed": embed}, exchange=exchange)
    try:
        pending = publish(writer, trainer, 1)
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        assert exchange.calls == [1] and exchange.abandoned == []
        with pytest.raises(StepTimedOut):
            reader.apply_next(timeout_s=0.3)
        assert exchange.calls == [1] and exchange.abandoned == ["StepTimedOut"]
        pending = publish(writer, trainer, 2, fault="dtype")  # fp32 `embed`
        with pytest.raises(StepFailed, match="receiver's dtype"):
            reader.apply_next(timeout_s=5)
        assert exchange.abandoned == ["StepTimedOut", "StepFailed"]  # once, though `apply` nests in it
        with pytest.raises(StepRejected):
            writer.wait_and_free(pending)
        exchange.fail = True
        pending = publish(writer, trainer, 3)
        with pytest.raises(StepFailed, match="the peers said no"):
            reader.apply_next(timeout_s=5)
        assert exchange.calls == [1, 3] and exchange.abandoned == ["StepTimedOut", "StepFailed"]
        with pytest.raises(StepRejected, match="the peers said no") as err:
            writer.wait_and_free(pending)
        assert err.value.freed
    finally:
        reader.close()
        writer.close()


def publish(writer: WeightWriter, trainer: Layout, step: int, fault: str | None = None) -> PendingStep:
    tensors, shards = trainer_step(trainer, 0, step, torch.device("cpu"), fault)
    return writer.publish(step, tensors, shards=shards)


@pytest.mark.timeout(60)
def test_trainer_tp2_rows_to_inference_tp2_columns_bitwise_over_several_steps(case_args: dict) -> None:
    case = Case(TP2_PARAMS, **case_args, steps=4, strided=("qkv", "o_proj"))
    ranks = records(run_world(rank_worker, 2, case))
    for rank, steps in enumerate(ranks):
        assert [s["step"] for s in steps] == [1, 2, 3, 4]
        for step in steps:
            assert_all_good(step, rank)
    # Rank 0 holds no part of `head`: it receives it whole; rank 1 sends it.
    assert ranks[0][0]["received"] >= 5 * 6 * 4 and ranks[1][0]["sent"] >= 5 * 6 * 4


@pytest.mark.timeout(60)
def test_trainer_tp3_to_replicated_and_uneven_splits_on_three_ranks_through_the_loader(
    case_args: dict,
) -> None:
    """As an SGLang TP worker runs it (sglang/loader.py's hooks), with layouts gathered through the group."""
    case = Case(TP3_PARAMS, **case_args, steps=3, via_loader=True, gather_layouts=True, strided=("w_col",))
    ranks = records(run_world(rank_worker, 3, case, timeout=50))
    for rank, steps in enumerate(ranks):
        assert [s["step"] for s in steps] == [1, 2, 3]
        for step in steps:
            assert_all_good(step, rank)
    assert all(r[0]["sent"] > 0 for r in ranks)  # every rank sends too (`bias` leaves ranks 1 and 2 whole)


@pytest.mark.timeout(60)
def test_row_ranges_from_other_gpus_land_in_the_targets_themselves_and_column_ranges_are_staged(
    case_args: dict,
) -> None:
    """Trainer TP3 -> the whole tensors on every GPU: the 8 rows of `w_col` from the two peers are row
    ranges of the target and are received straight into it; the 6 columns of `w_row` are strided there and
    go through staging. The counts are the same every step (decided once per plan)."""
    params = (
        Param("w_col", (12, 8), "bfloat16", "d0", "rep"),
        Param("w_row", (6, 9), "bfloat16", "d1", "rep"),
        Param("norm", (8,), "float32", "rep", "rep"),
    )
    case = Case(params, **case_args, steps=2, direct_min_bytes=16)
    ranks = records(run_world(rank_worker, 3, case, timeout=50))
    for rank, steps in enumerate(ranks):
        assert [s["step"] for s in steps] == [1, 2]
        for step in steps:
            assert_all_good(step, rank)
            assert (step["received_in_place"], step["received_staged"]) == (8 * 8 * 2, 6 * 6 * 2), step


@pytest.mark.timeout(60)
def test_a_trainer_that_never_publishes_fails_every_rank_at_its_timeout_then_the_next_step_works(
    case_args: dict,
) -> None:
    case = Case(TP2_PARAMS, **case_args, steps=3, reader_timeout_s=3.0, faults={"2:1": "silent"})
    r0, r1 = records(run_world(rank_worker, 2, case))
    for rank, step in enumerate((r0[0], r1[0])):
        assert_all_good(step, rank)
    assert r1[1]["ok"] is False and r1[1]["error"].startswith("StepTimedOut")
    assert r0[1]["ok"] is False and r0[1]["error"].startswith("ExchangeFailed")
    assert "rank 1 (timeout)" in r0[1]["error"]
    assert r0[1]["seconds"] < case.reader_timeout_s + 4.0  # told when rank 1 gave up, not at a timeout
    assert r0[1]["writer"] == "StepRejected freed=True"  # the trainer got the error ACK and freed
    for rank, step in enumerate((r0[2], r1[2])):
        assert_all_good(step, rank)


@pytest.mark.timeout(60)
def test_a_wrong_shape_or_dtype_on_one_rank_fails_every_rank_then_the_next_step_works(
    case_args: dict,
) -> None:
    case = Case(TP2_PARAMS, **case_args, steps=3, faults={"1:1": "shape", "2:0": "dtype"})
    r0, r1 = records(run_world(rank_worker, 2, case))
    # Step 1: rank 1's manifest disagrees with the trainer layout (caught before anything moves).
    assert "ExchangeFailed" in r1[0]["error"] and "the trainer layout says" in r1[0]["error"]
    assert "ExchangeFailed" in r0[0]["error"] and "rank 1 (layout)" in r0[0]["error"]
    # Step 2: rank 0's reader refuses the dtype before the exchange, and abandons it.
    assert "receiver's dtype" in r0[1]["error"]
    assert "ExchangeFailed" in r1[1]["error"] and "rank 0 (error)" in r1[1]["error"]
    for rank, steps in enumerate((r0, r1)):
        assert all(s["seconds"] < 5 for s in steps[:2]), [s["seconds"] for s in steps]
        assert all(s["writer"] == "StepRejected freed=True" for s in steps[:2]), steps[:2]
        assert_all_good(steps[2], rank)


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_is_bounded_by_the_agree_timeout(case_args: dict) -> None:
    case = Case(TP2_PARAMS, **case_args, steps=3, agree_timeout_s=3.0, faults={"2:1": "stall"})
    r0, r1 = records(run_world(rank_worker, 2, case))
    for rank, step in enumerate((r0[0], r1[0])):
        assert_all_good(step, rank)
    assert "ExchangeFailed" in r0[1]["error"] and "did not complete within 3 s" in r0[1]["error"]
    assert r0[1]["seconds"] < 3.0 + 3.0
    # The group may still hold the stalled collective: later steps fail at once instead of waiting again.
    assert "restart the workers" in r0[2]["error"] and r0[2]["seconds"] < 1.0
    assert r1[1]["fault"] == "stall" and len(r1) == 2


@pytest.mark.timeout(60)
def test_an_exchange_that_breaks_mid_wire_fails_every_rank_and_still_closes_every_mapping(
    case_args: dict,
) -> None:
    case = Case(TP2_PARAMS, **case_args, steps=2, p2p_timeout_s=3.0, faults={"2:1": "wire"})
    r0, r1 = records(run_world(rank_worker, 2, case))
    for rank, step in enumerate((r0[0], r1[0])):
        assert_all_good(step, rank)
    assert "ExchangeFailed" in r1[1]["error"] and "simulated" in r1[1]["error"]
    # Rank 0 waits on rank 1 in the chunk loop: a timeout or, once rank 1 has exited, a closed connection.
    assert "ExchangeFailed" in r0[1]["error"] and "peer 1" in r0[1]["error"]
    assert r0[1]["seconds"] < 3.0 + 3.0
    # The failed exchange's frames held views of the buckets; the reader still verified its close (an
    # error ACK with ipc_closed), so both trainers freed at once.
    assert r0[1]["writer"] == r1[1]["writer"] == "StepRejected freed=True"


def run_with_writer_processes(
    redis: RedisServer,
    tmp_path: Path,
    transport: str,
    backend: str,
) -> list[list[dict[str, Any]]]:
    """Each GPU's trainer in a process of its own (as in a pod); the readers in a `run_world`."""
    shm_dir = str(tmp_path / "shm")
    case = writers_case(MetaStoreAddress(redis.host, redis.port, redis.password), transport, shm_dir)
    env = {
        **os.environ,
        "REDIS_PORT": str(redis.port),
        "REDIS_PASSWORD": redis.password,
        "OMP_NUM_THREADS": "1",
    }
    writers = []
    for rank in range(2):
        log = open(tmp_path / f"writer{rank}.log", "ab")  # noqa: SIM115 (handed to the child)
        args = ["--rank", str(rank), "--world", "2", "--transport", transport, "--shm-dir", shm_dir]
        writers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.runtime.exchange_helpers", "writer", *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        log.close()
    try:
        result = run_world(rank_worker, 2, case, backend=backend, timeout=150)
    finally:
        codes = []
        for w in writers:
            try:
                codes.append(w.wait(timeout=30))
            except subprocess.TimeoutExpired:
                w.kill()
                codes.append(w.wait())
    ranks = records(result)
    assert codes == [0, 0], [(tmp_path / f"writer{r}.log").read_text()[-2000:] for r in range(2)]
    for rank, steps in enumerate(ranks):
        assert [s["step"] for s in steps] == [1, 2, 3]
        for step in steps:
            assert_all_good(step, rank)
    return ranks


@pytest.mark.timeout(90)
def test_trainers_in_processes_of_their_own(redis_server: RedisServer, tmp_path: Path) -> None:
    """The GPU test's plumbing on the CPU: writer processes, shared memory, gloo."""
    run_with_writer_processes(redis_server, tmp_path, "SharedMemory", "gloo")


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_tp2_rows_to_columns_nccl_and_cuda_ipc(redis_server: RedisServer, tmp_path: Path) -> None:
    run_with_writer_processes(redis_server, tmp_path, "CudaIPC", "nccl")
