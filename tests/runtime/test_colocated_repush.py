"""A restarted SGLang side gets the trainer's current weights again (colocated/repush.py): one process, the
writer on the main thread, readers on threads, shared-memory buckets, a real Redis. The kill of a real SGLang
side is in tests/test_demo_engine_recovery.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.repush import EngineWatch, push_again
from colocate_runtime.colocated.wiring import new_reader, new_writer
from colocate_runtime.colocated.writer import WeightWriter
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_config
from tests.runtime.test_colocated_protocol import ReaderThread, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cfg(redis_server: RedisServer, tmp_path: Path) -> ColocateConfig:
    return shm_config(redis_server, tmp_path / "shm", COLOCATE_BUCKET_MB="1")


@pytest.fixture
def writer(cfg: ColocateConfig) -> Iterator[WeightWriter]:
    w = new_writer(cfg)
    yield w
    w.close()


def test_a_restarted_reader_gets_the_last_step_again_bitwise(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    watch = EngineWatch(writer)
    writer.store.register_engine(writer.uuid)  # the first SGLang side, at its start
    assert not watch.restarted()  # no step installed yet: nothing to push again
    with ReaderThread(new_reader(cfg, model.targets())) as first:
        for step in (1, 2):
            writer.update(step, model.weights(step), weight_version=str(step))
            watch.mark()
        wait_for(lambda: len(first.reports) == 2)
    assert not watch.restarted()

    # SGLang restarts alone: a new process, fresh weights, a new engine instance. The trainer notices and
    # pushes the weights it holds now (step 2's) once more: no new step, no new trainer generation.
    writer.store.register_engine(writer.uuid)
    assert watch.restarted() and watch.wait_restarted(1)
    gen = writer.gen
    targets = model.targets()
    with ReaderThread(new_reader(cfg, targets)) as second:
        report = writer.wait_and_free(push_again(writer, model.weights(2), weight_version="2"))
        watch.mark()
        assert (report.step, report.gen) == (2, gen)
        assert model.all_equal(model.weights(2), targets) == []
        assert not watch.restarted()
        # Training goes on with the new engine.
        writer.update(3, model.weights(3), weight_version="3")
        assert model.all_equal(model.weights(3), targets) == []
        wait_for(lambda: len(second.reports) == 2)
        assert second.errors == []
    assert (writer.gen, writer.last_step) == (gen, 3)
    assert writer.store.current_gen(writer.uuid) == gen


def test_only_the_last_step_can_be_published_again(writer: WeightWriter) -> None:
    with pytest.raises(ValueError, match="no step published yet"):
        writer.republish()
    with pytest.raises(ValueError, match="not the last published step"):
        writer.publish(1, model.weights(1), again=True)
