"""The Megatron facade after SGLang restarted alone: `Publisher.before_rollout` notices the new engine
instance on the GPU and installs the weights the trainer holds once more, bit for bit, as the last step.

One process: the Publisher over a bare tiny Qwen3-MoE rank (bench/step_bench.py's `tiny` preset: Megatron
TP 2 / EP 2 rank 0 to SGLang TP 2 / EP 2 rank 0, one gloo rank, `engine=False`), the SGLang worker's reader on
a thread, shared-memory buckets and a real Redis. A restart is what SGLang's start does on that GPU: a new
engine instance registered (`MetaStore.register_engine`) and a reader with fresh parameters."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.reader import WeightReader
from colocate_runtime.colocated.wiring import new_reader
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.megatron import Publisher
from colocate_runtime.shards import TensorShard
from tests.runtime.colocated_env import shm_env
from tests.runtime.test_colocated_protocol import ReaderThread, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the bench scripts import as scripts
import step_bench

pytestmark = pytest.mark.timeout(120)
PRESET = step_bench.PRESETS["tiny"]


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path) -> Iterator[dict[str, str]]:
    yield shm_env(redis_server, tmp_path / "shm", COLOCATE_STEP_TIMEOUT_SECONDS="20")
    if dist.is_initialized():  # new_publisher's one-rank gloo world
        dist.destroy_process_group()


class Worker:
    """What SGLang's TP worker on this GPU holds and reads into: its parameters, cut to the trainer rank's."""

    def __init__(self, cfg: ColocateConfig) -> None:
        tplan, iplan = step_bench.plans(PRESET)
        dtype = torch_dtype(iplan.spec.dtype)
        params = {n: torch.zeros(s, dtype=dtype) for n, s in iplan.param_shapes().items()}
        local = step_bench.local_boxes(tplan, iplan)
        self.targets: dict[str, torch.Tensor] = {}
        shards = {}
        for shard, view in iplan.read(params):
            if shard.name in local:
                box = local[shard.name]
                self.targets[shard.name] = view[box.relative_to(shard.box).slices()]
                shards[shard.name] = TensorShard(shard.name, shard.global_shape, shard.dtype, box)
        self.reader: WeightReader = new_reader(cfg, self.targets, target_shards=shards)


def published(tplan, tensors: dict[str, torch.Tensor], worker: Worker) -> list[str]:  # type: ignore[no-untyped-def]
    """The canonical pieces whose bits differ between the trainer's tensors and the worker's targets."""
    local = step_bench.local_boxes(*step_bench.plans(PRESET))
    wrong = []
    for piece in tplan.bind(tensors):
        name = piece.shard.name
        if name in worker.targets:
            want = piece.data()[local[name].relative_to(piece.shard.box).slices()]
            if not torch.equal(want.view(torch.int16), worker.targets[name].view(torch.int16)):
                wrong.append(name)
    return wrong


def train(tensors: dict[str, torch.Tensor], step: int) -> None:
    for t in tensors.values():
        t.view(torch.int16)[:: 7 + step].add_(step)


def test_a_restarted_engine_gets_the_trainers_weights_again(env: dict[str, str]) -> None:
    cfg = ColocateConfig.from_env(env)
    tplan, _ = step_bench.plans(PRESET)
    _, tensors, _ = step_bench.megatron_rank(tplan, "inplace", torch.device("cpu"))
    publisher: Publisher = step_bench.new_publisher(PRESET, tplan, tensors, env, "inplace")
    assert publisher.writer is not None
    store, uuid = publisher.writer.store, publisher.writer.uuid
    try:
        store.register_engine(uuid)  # SGLang's worker on this GPU, at its start
        first = Worker(cfg)
        with ReaderThread(first.reader):
            assert publisher.before_rollout() is False  # nothing installed yet: nothing to push again
            for step in (1, 2):
                train(tensors, step)
                publisher.update(step)
                assert published(tplan, tensors, first) == []
                assert publisher.before_rollout() is False  # the same engine: one read, nothing else

        # SGLang restarts alone, from the checkpoint (here: zeros); the trainer holds step 2's weights.
        store.register_engine(uuid)
        second = Worker(cfg)
        with ReaderThread(second.reader) as reading:
            assert published(tplan, tensors, second) != []
            assert publisher.before_rollout() is True
            wait_for(lambda: len(reading.reports) == 1)
            assert published(tplan, tensors, second) == []
            assert publisher.writer.last_step == 2  # the same step again: nothing the operator counts twice
            assert publisher.before_rollout() is False
            train(tensors, 3)
            publisher.update(3)  # and the steps go on
            assert published(tplan, tensors, second) == []
            assert not reading.errors
    finally:
        publisher.close()
