"""The slime updater's contract and order, with no slime, Ray or SGLang (fast; in `make test`).

One gloo rank; the engines are fakes whose `.method.remote()` calls land in one ordered log, `ray_get`
unwraps them, and the Publisher is a fake whose `update` drives the engine's rollout as the real one does
(install, then confirm). What slime's own `UpdateWeightFromTensor.update_weights` does against the engines
(624b824: rank 0 pauses every engine, flushes them, the weights move, rank 0 continues every engine) must be
what ours does, with our loader's calls in the middle and the version set only after the step is confirmed.
test_slime_real.py runs the same against slime's code, real SGLang and real megatron-core.
"""

from __future__ import annotations

import datetime
from argparse import Namespace
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from colocate_devcluster.processes import free_port
from colocate_runtime.colocated.outcome import StepReport
from colocate_runtime.integrations.slime import (
    UnsupportedSlimeSetup,
    UpdateWeightFromColocate,
    check_slime_args,
)
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, StepNotInstalled

ENV = {
    "COLOCATE_JOB_NAME": "slime-unit",
    "COLOCATE_NAMESPACE": "unit",
    "COLOCATE_METASTORE_ADDR": "127.0.0.1:1",  # never dialed: the Publisher is a fake
    "COLOCATE_METASTORE_PASSWORD": "unused",
    "COLOCATE_STEP_TIMEOUT_SECONDS": "30",
}


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    yield
    dist.destroy_process_group()


class Engine:
    """slime's SGLangEngine methods the updater calls, each logged as (engine, method, kwargs)."""

    def __init__(self, name: str, log: list[tuple], fail_update: bool = False) -> None:
        self.name, self.log, self.fail_update = name, log, fail_update

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)

        def remote(*args: Any, **kwargs: Any) -> tuple[str, Any]:
            self.log.append((self.name, method, kwargs))
            if method == "update_weights_from_tensor" and self.fail_update:
                raise RuntimeError("HTTP 500")
            return ("ref", method)

        return SimpleNamespace(remote=remote)


def ray_get(refs: Any) -> Any:
    return [r[1] for r in refs] if isinstance(refs, list) else refs[1]


class FakePublisher:
    def __init__(self, log: list[tuple], confirm_error: Exception | None = None, **kwargs: Any) -> None:
        self.log, self.kwargs, self.confirm_error = log, kwargs, confirm_error
        self.rollout: Any = None
        log.append(("publisher", "start", kwargs))

    def update(self, step: int, *, weight_version: str) -> StepReport:
        self.log.append(("publisher", "update", {"step": step, "weight_version": weight_version}))
        report = StepReport(gen=1, step=step, weight_version=weight_version, bytes=1234, handles=1)

        def confirm() -> StepReport:
            self.log.append(("publisher", "confirm", {}))
            if self.confirm_error is not None:
                raise self.confirm_error
            return report

        if self.rollout is None:
            return report
        return self.rollout.install_weights(weight_version, confirm=confirm)

    def finish(self, **kwargs: Any) -> None:
        self.log.append(("publisher", "finish", kwargs))


def args(**over: Any) -> Namespace:
    base = {
        "offload_train": False,
        "update_weight_mode": "full",
        "hf_checkpoint": "/models/qwen3",
        "actor_num_nodes": 1,
        "actor_num_gpus_per_node": 2,
        "rollout_num_gpus_per_engine": 2,
    }
    return Namespace(**{**base, **over})


def updater(log: list[tuple], confirm_error: Exception | None = None, **kw: Any) -> UpdateWeightFromColocate:
    return UpdateWeightFromColocate(
        args(**kw),
        [object()],
        lambda: {},
        model_name="qwen3",
        quantization_config=None,
        environ=ENV,
        ray_get=ray_get,
        publisher_factory=lambda model, **kwargs: FakePublisher(log, confirm_error, **kwargs),
    )


def update_call(load_format: str, version: str | None) -> dict[str, Any]:
    return {
        "serialized_named_tensors": [EMPTY_PAYLOAD] * 2,
        "load_format": load_format,
        "flush_cache": False,
        "weight_version": version,
    }


def test_slime_order_with_our_step_in_the_middle(one_rank: None) -> None:
    log: list[tuple] = []
    upd = updater(log)
    upd.weight_version = 7  # slime sets update_weight_start_version after construction
    engines = [Engine("e0", log)]
    upd.connect_rollout_engines(engines, None, engine_gpu_counts=[2], engine_gpu_offsets=[0])
    assert log == [
        ("e0", "update_weights_from_tensor", update_call(INIT_LOADER_PATH, None)),
        ("publisher", "start", {"hf_config": "/models/qwen3", "environ": ENV, "engine": False}),
    ]
    log.clear()
    upd.update_weights()
    assert [(who, what) for who, what, _ in log] == [
        ("e0", "pause_generation"),
        ("e0", "flush_cache"),
        ("publisher", "update"),
        ("e0", "update_weights_from_tensor"),
        ("publisher", "confirm"),
        ("e0", "update_weights_from_tensor"),
        ("e0", "continue_generation"),
    ]
    assert log[2][2] == {"step": 8, "weight_version": "8"}
    assert log[3][2] == update_call(LOADER_PATH, None)  # the version is not set before the confirmation
    assert log[5][2] == update_call(INIT_LOADER_PATH, "8")
    assert upd.weight_version == 8
    metrics = upd.pop_metrics()
    assert metrics["update_weights/colocate_bytes"] == 1234
    assert metrics["update_weights/colocate_seconds"] >= 0
    assert upd.pop_metrics() == {}
    upd.finish()
    assert log[-1] == ("publisher", "finish", {"ok": True, "error": ""})


def test_a_step_not_confirmed_leaves_the_engines_paused_without_a_version(one_rank: None) -> None:
    log: list[tuple] = []
    upd = updater(log, confirm_error=RuntimeError("reader failed on rank 1"))
    upd.connect_rollout_engines([Engine("e0", log)], None, engine_gpu_counts=[2], engine_gpu_offsets=[0])
    log.clear()
    with pytest.raises(StepNotInstalled, match="reader failed on rank 1"):
        upd.update_weights()
    methods = [what for _, what, _ in log]
    assert "continue_generation" not in methods
    assert [kw.get("weight_version") for _, what, kw in log if what == "update_weights_from_tensor"] == [None]


def test_rank_zero_pauses_and_continues_every_engine_but_drives_only_its_own(one_rank: None) -> None:
    """Two engines of one GPU each (slime's engine i serves ranks [offset_i, offset_i + count_i)): rank 0
    pauses and continues both, and drives only the engine on its GPU."""
    log: list[tuple] = []
    upd = updater(log, actor_num_gpus_per_node=2, rollout_num_gpus_per_engine=1)
    upd.connect_rollout_engines([Engine("e0", log), Engine("e1", log)], None)  # slime's dense fallback
    assert upd.rollout is not None and upd.rollout.engine.name == "e0" and upd.rollout.tp_size == 1
    log.clear()
    upd.update_weights()
    by_engine = {(who, what) for who, what, _ in log}
    assert {("e0", "pause_generation"), ("e1", "pause_generation")} <= by_engine
    assert {("e0", "continue_generation"), ("e1", "continue_generation")} <= by_engine
    assert ("e1", "update_weights_from_tensor") not in by_engine


def test_only_the_first_rank_of_an_engine_drives_it(one_rank: None) -> None:
    upd = updater([])
    upd.rank = 1  # the second trainer rank on the engine's two GPUs
    upd._map_engines([Engine("e0", [])], [2], [0], None)
    assert upd.rollout is None


def test_an_engine_failure_is_every_rank_s_failure(one_rank: None) -> None:
    from colocate_runtime.megatron import RankFailed

    log: list[tuple] = []
    upd = updater(log)
    with pytest.raises(RankFailed, match=r"connecting the colocated rollout engines failed on rank 0.*HTTP"):
        upd.connect_rollout_engines([Engine("e0", log, fail_update=True)], None, [2], [0])


@pytest.mark.parametrize(
    ("over", "environ", "says"),
    [
        ({"offload_train": True}, {}, "--no-offload-train"),
        ({}, {"LD_PRELOAD": "/x/torch_memory_saver_hook_mode_preload_cu12.abi3.so"}, "LD_PRELOAD"),
        ({}, {"TMS_INIT_ENABLE": "1"}, "torch_memory_saver"),
        ({"update_weight_mode": "delta"}, {}, "--update-weight-mode delta"),
        ({}, {"SLIME_ENABLE_EXPANDABLE_SEGMENTS": "1"}, "SLIME_ENABLE_EXPANDABLE_SEGMENTS=1"),
    ],
    ids=["offload-train", "tms-preload", "tms-init", "delta", "expandable-segments"],
)
def test_unsupported_setups_are_refused_naming_the_flag(over: dict, environ: dict, says: str) -> None:
    with pytest.raises(UnsupportedSlimeSetup, match=says):
        check_slime_args(args(**over), environ)


def test_engines_off_the_trainer_s_gpus_or_quantized_weights_are_refused(one_rank: None) -> None:
    upd = updater([])
    with pytest.raises(UnsupportedSlimeSetup, match="beyond the trainer's 2 GPUs"):
        upd._map_engines([Engine("e0", []), Engine("e1", [])], [2, 2], [0, 2], None)
    with pytest.raises(UnsupportedSlimeSetup, match="lies on no engine's GPUs"):
        upd._map_engines([Engine("e0", [])], [1], [1], None)
    with pytest.raises(UnsupportedSlimeSetup, match="data-parallel"):
        upd._map_engines([Engine("e0", [])], [2], [0], [{"dp_size": 2}])
    with pytest.raises(UnsupportedSlimeSetup, match="compressed-tensors"):
        UpdateWeightFromColocate(
            args(), [], None, quantization_config={"quant_method": "compressed-tensors"}, environ=ENV
        )
