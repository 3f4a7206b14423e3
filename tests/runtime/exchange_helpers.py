"""Test support for the colocated update with a cross-GPU exchange: synthetic models whose trainer and
inference layouts differ, per-rank workers (writer and reader of one GPU) for `p2p_helpers.run_world`, and a
writer process for the GPU variant (`python -m tests.runtime.exchange_helpers writer ...`).

Every process regenerates the same reference tensors from the parameter name and the step, so each reader
checks its targets bitwise. All ranks belong to one job, as the GPUs of a pod do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from colocate_runtime.colocated.config import ColocateConfig, MetaStoreAddress
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.p2p.layout import Layout, ParamShards, split_box
from colocate_runtime.shards import Box, TensorShard, stable_hash

SENTINEL = -7777.0  # what an element nobody wrote holds (exact in bf16 and fp32)


@dataclass(frozen=True)
class Param:
    """`trainer` and `inference` say how each side holds it: "rep" (whole on every rank), "dN" (split
    along dim N over all ranks, uneven where the size does not divide) or "onK" (whole on rank K only)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainer: str
    inference: str


@dataclass(frozen=True)
class Case:
    params: tuple[Param, ...]
    redis: MetaStoreAddress
    shm_dir: str = ""
    job: str = "rl-job"
    transport: str = "SharedMemory"
    steps: int = 3
    reader_timeout_s: float = 10.0  # how long a reader waits for its trainer's step
    step_timeout_s: float = 10.0
    agree_timeout_s: float | None = None  # None: from the config (step timeout + margin)
    p2p_timeout_s: float = 20.0
    direct_min_bytes: int | None = None  # the executor's own-message threshold (None: its default)
    inline_writer: bool = True  # the rank publishes itself; False: a writer process per GPU does
    via_loader: bool = False  # apply through sglang/loader.py's hooks
    gather_layouts: bool = False  # each rank states only its own shards; gather_layout collects them
    strided: tuple[str, ...] = ()  # targets given as non-contiguous views
    faults: dict[str, str] = field(default_factory=dict)  # "step:rank" -> silent|shape|dtype|stall|wire

    def layouts(self, world: int) -> tuple[Layout, Layout]:
        return _layout(self.params, world, "trainer"), _layout(self.params, world, "inference")

    def config(self) -> ColocateConfig:
        return ColocateConfig(
            job=self.job,
            namespace="team-a",
            metastore=self.redis,
            transport=self.transport,
            shm_dir=self.shm_dir or "/dev/shm",
            step_timeout_s=self.step_timeout_s,
            heartbeat_ttl_s=2.0,
            key_ttl_s=120,
            bucket_bytes=1 << 20,
        )


def _layout(params: tuple[Param, ...], world: int, side: str) -> Layout:
    out = []
    for p in params:
        kind = getattr(p, side)
        if kind == "rep":
            shards = [(r, Box.full(p.shape)) for r in range(world)]
        elif kind.startswith("d"):
            shards = [(r, split_box(p.shape, int(kind[1:]), world, r)) for r in range(world)]
        elif kind.startswith("on"):
            shards = [(int(kind[2:]), Box.full(p.shape))]
        else:
            raise ValueError(f"{p.name}: unknown placement {kind!r}")
        out.append(ParamShards(p.name, p.shape, p.dtype, tuple(shards)))
    return Layout.of(out)


def reference(name: str, shape: tuple[int, ...], dtype: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(stable_hash(f"{name}@{step}")[:8], 16))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch_dtype(dtype))


def trainer_step(
    layout: Layout, rank: int, step: int, device: torch.device, fault: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, TensorShard]]:
    """What the trainer on this GPU publishes at `step`; `fault` breaks one tensor ("shape": a box one row
    short, "dtype": fp32 where the layout says otherwise)."""
    tensors, shards = {}, {}
    broken = fault not in ("shape", "dtype")
    for s in layout.rank_shards(rank).shards:
        box, dtype = s.box, s.dtype
        if not broken and fault == "shape" and box.lengths[0] > 1:
            box, broken = Box(box.offsets, (box.lengths[0] - 1, *box.lengths[1:])), True
        if not broken and fault == "dtype" and dtype != "float32":
            dtype, broken = "float32", True
        data = reference(s.name, s.global_shape, s.dtype, step)[box.slices()].to(torch_dtype(dtype))
        tensors[s.name] = data.to(device)
        shards[s.name] = TensorShard(s.name, s.global_shape, dtype, box)
    return tensors, shards


def make_targets(
    layout: Layout, rank: int, device: torch.device, strided: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    out = {}
    for s in layout.rank_shards(rank).shards:
        dtype = torch_dtype(s.dtype)
        shape = s.box.lengths
        if s.name in strided and len(shape) == 2:
            out[s.name] = torch.empty(shape[::-1], dtype=dtype, device=device).t()  # column-major view
        else:
            out[s.name] = torch.empty(shape, dtype=dtype, device=device)
    return out


def wrong_targets(layout: Layout, rank: int, step: int, targets: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for s in layout.rank_shards(rank).shards:
        want = reference(s.name, s.global_shape, s.dtype, step)[s.box.slices()].contiguous()
        got = targets[s.name].cpu().contiguous()
        if got.shape != want.shape or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad.append(s.name)
    return bad


# Trainer TP2 -> inference TP2 along the other dimension, plus replicated, identical and one-rank params.
TP2_PARAMS = (
    Param("qkv", (10, 6), "bfloat16", "d0", "d1"),  # column-parallel in training, split by columns here
    Param("o_proj", (7, 9), "bfloat16", "d1", "d0"),  # the reverse, uneven (4 + 3 rows)
    Param("norm", (6,), "float32", "rep", "rep"),  # replicated on both sides: all local
    Param("embed", (11, 6), "bfloat16", "d0", "d0"),  # identical shards: all local
    Param("head", (5, 6), "float32", "on1", "rep"),  # a last pipeline stage's tensor, wanted everywhere
)

# Trainer TP3 (uneven) -> inference TP1 replicated on every GPU, and uneven resplits.
TP3_PARAMS = (
    Param("w_col", (10, 4), "bfloat16", "d0", "rep"),  # 4 + 3 + 3 rows -> whole on every rank
    Param("w_row", (5, 7), "bfloat16", "d1", "d0"),  # 3 + 2 + 2 columns -> 2 + 2 + 1 rows
    Param("norm", (5,), "float32", "rep", "rep"),
    Param("head", (4, 5), "bfloat16", "on2", "d1"),  # one rank's tensor split over all
    Param("bias", (7,), "float32", "d0", "on0"),  # only rank 0 needs it: ranks 1, 2 only send
)


# --- one rank: its GPU's writer (inline) and reader, joined to the others through the exchange -----------


def rank_worker(rank: int, world: int, case: Case) -> list[dict[str, Any]]:
    from colocate_runtime.colocated.exchange import ReshardExchange, gather_layout
    from colocate_runtime.colocated.wiring import new_reader, new_writer, reshard_exchange
    from colocate_runtime.p2p.config import ExecutorConfig

    cfg = case.config()
    trainer, inference = case.layouts(world)
    cuda = case.transport == "CudaIPC"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if case.gather_layouts:
        gathered = gather_layout(trainer.rank_shards(rank)), gather_layout(inference.rank_shards(rank))
        assert gathered == (trainer, inference), "gathered layouts differ from the computed ones"
        trainer, inference = gathered
    threshold = {} if case.direct_min_bytes is None else {"direct_min_bytes": case.direct_min_bytes}
    config = ExecutorConfig(timeout_s=case.p2p_timeout_s, **threshold)
    if case.agree_timeout_s is None:
        exchange = reshard_exchange(cfg, trainer, inference, device=device, config=config)
    else:
        exchange = ReshardExchange.create(
            trainer, inference, device=device, config=config, agree_timeout_s=case.agree_timeout_s
        )
    targets = make_targets(inference, rank, device, case.strided)
    if case.via_loader:
        reader, apply = _loader_reader(cfg, targets, exchange, case.reader_timeout_s)
    else:
        reader = new_reader(
            cfg,
            targets,
            rank=exchange.rank,
            device=rank if cuda else None,
            target_shards=exchange.target_shards(),
            exchange=exchange,
        )

        def apply() -> None:
            reader.apply_next(timeout_s=case.reader_timeout_s)

    writer = new_writer(cfg, rank=rank) if case.inline_writer else None
    total_bytes = sum(t.numel() * t.element_size() for t in targets.values())
    records: list[dict[str, Any]] = []
    try:
        for step in range(1, case.steps + 1):
            fault = case.faults.get(f"{step}:{rank}")
            record: dict[str, Any] = {"step": step, "fault": fault}
            records.append(record)
            if fault == "stall":  # never reaches the step: the peers' wait is bounded by agree_timeout_s
                time.sleep(exchange.agree_timeout_s + 2.0)
                break
            if fault == "wire":
                _break_the_wire(exchange, rank)
            for t in targets.values():
                t.fill_(SENTINEL)
            pending = None
            if writer is not None and fault != "silent":
                tensors, shards = trainer_step(trainer, rank, step, device, fault)
                pending = writer.publish(step, tensors, shards=shards)
            t0 = time.monotonic()
            try:
                apply()
                last = reader.history.last()
                assert last is not None and last.step == step
                report = exchange.last_report
                assert report is not None
                record.update(
                    ok=True,
                    wrong=wrong_targets(inference, rank, step, targets),
                    copied_locally=last.bytes,
                    received=report.bytes_received,
                    received_in_place=report.received_in_place,
                    received_staged=report.received_staged,
                    sent=report.bytes_sent,
                    p2p_local=report.bytes_local,
                    target_bytes=total_bytes,
                )
            except StepFailed as err:
                record.update(ok=False, error=f"{type(err).__name__}: {err}")
            record["seconds"] = time.monotonic() - t0
            if pending is not None:
                try:
                    writer.wait_and_free(pending)
                    record["writer"] = "ok"
                except StepFailed as err:
                    record["writer"] = f"{type(err).__name__} freed={err.freed}"
    finally:
        reader.close()
        if writer is not None:
            writer.close()
    return records


def _break_the_wire(exchange: Any, rank: int) -> None:
    """The chunk loop of this rank fails as on a lost peer, holding the bound views of the mapped buckets in
    its frame as the real one would: the reader's close must still be verified."""
    from colocate_runtime.p2p.errors import PeerTimeoutError

    def lost(work: Any, local: Any, *rest: Any) -> None:
        raise PeerTimeoutError(
            f"rank {rank}: simulated: the wire to the peer broke", peer=0, chunk=0, round_=0
        )

    exchange.p2p._exchange = lost


def _loader_reader(cfg: ColocateConfig, targets: dict[str, torch.Tensor], exchange: Any, timeout_s: float):
    """The SGLang worker's path: sglang/loader.py with both resolvers set, as a TP worker would."""
    from colocate_runtime.sglang import loader

    os.environ.update(
        {
            "COLOCATE_JOB_NAME": cfg.job,
            "COLOCATE_NAMESPACE": cfg.namespace,
            "COLOCATE_METASTORE_ADDR": f"{cfg.metastore.host}:{cfg.metastore.port}",
            "COLOCATE_METASTORE_PASSWORD": cfg.metastore.password,
            "COLOCATE_TRANSPORT": cfg.transport,
            "COLOCATE_SHM_DIR": cfg.shm_dir,
            "COLOCATE_STEP_TIMEOUT_SECONDS": str(timeout_s),
            "COLOCATE_HEARTBEAT_TTL_SECONDS": str(cfg.heartbeat_ttl_s),
            "COLOCATE_KEY_TTL_SECONDS": str(cfg.key_ttl_s),
            "COLOCATE_BUCKET_MB": "1",
        }
    )
    model = torch.nn.Module()
    loader.set_target_resolver(lambda _model: targets)
    loader.set_exchange_resolver(lambda _model, _cfg: exchange)
    reader = loader.reader_for(model)
    return reader, lambda: loader.load_colocated_step(model, [])


# --- the GPU variant's trainer: one process per GPU (CUDA IPC cannot map a bucket in its own process) -----


def writers_case(redis: MetaStoreAddress, transport: str, shm_dir: str = "") -> Case:
    """Trainer TP2 rows -> inference TP2 columns with a writer process per GPU (as in a pod: the trainer is
    another process; CUDA IPC cannot map a bucket in the process that exported it)."""
    return Case(
        TP2_PARAMS,
        redis,
        shm_dir=shm_dir,
        transport=transport,
        inline_writer=False,
        steps=3,
        reader_timeout_s=60.0,  # covers the writers' start (torch import, CUDA init)
        step_timeout_s=60.0,
        strided=("qkv",),
    )


def writer_main(argv: list[str]) -> int:
    from colocate_runtime.colocated.wiring import new_writer

    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--transport", default="CudaIPC")
    p.add_argument("--shm-dir", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    redis = MetaStoreAddress("127.0.0.1", int(os.environ["REDIS_PORT"]), os.environ["REDIS_PASSWORD"])
    case = writers_case(redis, args.transport, args.shm_dir)
    cuda = args.transport == "CudaIPC"
    if cuda:
        torch.cuda.set_device(args.rank)
    device = torch.device("cuda", args.rank) if cuda else torch.device("cpu")
    trainer, _ = case.layouts(args.world)
    writer = new_writer(case.config(), rank=args.rank, device=args.rank if cuda else None)
    try:
        for step in range(1, case.steps + 1):
            tensors, shards = trainer_step(trainer, args.rank, step, device)
            writer.update(step, tensors, shards=shards)
            print(f"writer {args.rank}: step {step} acknowledged", flush=True)
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["writer"]:
        raise SystemExit("usage: python -m tests.runtime.exchange_helpers writer --rank R --world W [...]")
    sys.exit(writer_main(sys.argv[2:]))
