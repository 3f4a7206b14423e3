"""The SGLang loader with no user module, over real processes: two TP workers joined by gloo, a real
redis-server, shared memory for CUDA IPC.

Each worker process is one GPU: its trainer rank converts its Megatron-core state dicts
(`trainer_plan(...).convert`, from tests/runtime/megatron_layout.py) and publishes the canonical pieces
through a real writer, after writing its `TrainerRecord` under the writer's UUID; the SGLang side is a model
shaped as SGLang holds it (`inference_plan(...).param_shapes()`, fused qkv_proj / gate_up_proj / w13 / w2,
padded vocabulary) with the transformers `config` SGLang would give it, filled only through
`loader.load_colocated_step` with no resolver set. After every step each worker's parameters must equal, bit
for bit, `inference_plan(...).write` of the reference weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from tests.runtime.p2p_helpers import run_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_QWEN3_MOE = {
    **_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


@dataclass(frozen=True)
class AutoCase:
    """One engine of two TP workers; `parallel` is the trainer's Megatron setup (tests.runtime.megatron_layout
    `Parallel` kwargs) and `ranks[r]` the Megatron coordinates of the trainer rank on GPU r."""

    model: dict[str, Any]
    parallel: dict[str, Any]
    ranks: tuple[dict[str, int], ...]
    env: dict[str, str] = field(default_factory=dict)
    steps: int = 2
    records_on: tuple[int, ...] = (0, 1)  # GPUs whose trainer writes its record


def _config(model: dict[str, Any]) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(**model)


class ShapedLikeSGLang(torch.nn.Module):
    """SGLang's parameters of one TP worker (dotted names, fused layouts) and its `config`."""

    def __init__(self, params: dict[str, torch.Tensor], config: Any) -> None:
        super().__init__()
        self._params = params
        self.config = config

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def, override]
        return iter(self._params.items())


def reference(spec: Any, step: int) -> dict[str, torch.Tensor]:
    """The canonical weights of `step`, the same in every process."""
    from colocate_runtime.convert import canonical_tensors
    from colocate_runtime.dtypes import torch_dtype

    g = torch.Generator().manual_seed(1000 + step)
    return {
        name: torch.randn(t.shape, generator=g).to(torch_dtype(t.dtype))
        for name, t in sorted(canonical_tensors(spec).items())
    }


def sglang_params(iplan: Any, canonical: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Zeroed parameters of an SGLang worker; with `canonical`, written by `inference_plan(...).write`."""
    from colocate_runtime.dtypes import torch_dtype

    dtypes = {p.name: next((pl.shard.dtype for pl in p.placements), iplan.spec.dtype) for p in iplan.params}
    params = {n: torch.zeros(s, dtype=torch_dtype(dtypes[n])) for n, s in iplan.param_shapes().items()}
    for shard in iplan.shards() if canonical is not None else ():
        iplan.write(params, shard, canonical[shard.name][shard.box.slices()])
    return params


class _ListHandler(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def auto_worker(rank: int, world: int, case: AutoCase) -> dict[str, Any]:
    """GPU `rank`: its trainer rank publishes, its SGLang worker loads through the loader alone."""
    os.environ.update(case.env)
    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.outcome import StepFailed
    from colocate_runtime.colocated.wiring import new_writer
    from colocate_runtime.convert import MegatronRank, SGLangLayout, inference_plan, model_spec, trainer_plan
    from colocate_runtime.convert.published import TrainerRecord
    from colocate_runtime.sglang import loader
    from tests.runtime.megatron_layout import Parallel, megatron_chunks

    spec = model_spec(case.model)
    par = Parallel(**case.parallel)
    layout, mrank = par.layout(spec.num_layers), MegatronRank(**case.ranks[rank])
    tplan = trainer_plan(spec, layout, mrank)
    iplan = inference_plan(spec, SGLangLayout(tp=world), rank)
    model = ShapedLikeSGLang(sglang_params(iplan, None), _config(case.model))
    loader.start_colocated(model, [])  # the init call: this worker answers the writer's preflight
    writer = new_writer(ColocateConfig.from_env(os.environ), rank=rank)
    if rank in case.records_on:
        record = TrainerRecord(layout, mrank, spec.dtype, spec.architecture)
        writer.store.write_trainer_record(writer.uuid, record.to_json())
    out: dict[str, Any] = {"wrong": {}, "errors": [], "log": []}
    logged = _ListHandler(out["log"])
    logging.getLogger("colocate_runtime.sglang").addHandler(logged)
    logging.getLogger("colocate_runtime.sglang").setLevel(logging.INFO)
    try:
        for step in range(1, case.steps + 1):
            canonical = reference(spec, step)
            pieces = tplan.convert(megatron_chunks(spec, canonical, par, mrank))
            tensors = {s.name: d for s, d in pieces}
            pending = writer.publish(step, tensors, shards={s.name: s for s, _ in pieces})
            loader.load_colocated_step(model, [])  # never raises: the writer is the judge
            try:
                writer.wait_and_free(pending)
            except StepFailed as err:
                out["errors"].append(f"step {step}: {type(err).__name__}: {err}")
                continue
            want = sglang_params(iplan, canonical)
            out["wrong"][step] = [
                n
                for n, t in want.items()
                if not torch.equal(t.view(torch.uint8), model._params[n].view(torch.uint8))
            ]
        reader = loader._readers.get(id(model))
        out["path"] = None if reader is None else ("exchange" if reader.exchange is not None else "local")
        out["received"] = getattr(getattr(reader, "exchange", None), "last_report", None) is not None
    finally:
        writer.close()
        loader.close_all()
    return out


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "shm").mkdir()
    return {
        "COLOCATE_JOB_NAME": "auto-job",
        "COLOCATE_NAMESPACE": "team-a",
        **redis_server.env(),
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(tmp_path / "shm"),
        "COLOCATE_STEP_TIMEOUT_SECONDS": "20",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "2",
        "COLOCATE_IPC_PREFLIGHT": "Wait",
        "COLOCATE_BUCKET_MB": "1",
    }


def run(case: AutoCase) -> list[dict[str, Any]]:
    result = run_world(auto_worker, 2, case, timeout=150.0)
    assert not result.errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(result.errors.items()))
    return result.results


def assert_bitwise(results: list[dict[str, Any]], steps: int, path: str) -> None:
    for rank, out in enumerate(results):
        assert out["errors"] == [], f"worker {rank}: {out['errors']}"
        assert sorted(out["wrong"]) == list(range(1, steps + 1)), (
            f"worker {rank}: steps {sorted(out['wrong'])}"
        )
        assert all(w == [] for w in out["wrong"].values()), f"worker {rank}: wrong parameters {out['wrong']}"
        assert out["path"] == path, f"worker {rank} took the {out['path']} path"


TP2 = ({"tp_rank": 0}, {"tp_rank": 1})


def test_tp2_trainer_to_tp2_engine_with_equal_vocab_padding_reads_locally(env: dict[str, str]) -> None:
    """vocab 256: Megatron pads to 128 x 2 = 256, SGLang to 64: the same rows on each GPU."""
    case = AutoCase(_QWEN3, {"tp": 2, "divisor": 128}, TP2, env)
    assert_bitwise(run(case), case.steps, "local")


def test_two_data_parallel_tp1_trainer_ranks_feed_a_tp2_engine_locally(env: dict[str, str]) -> None:
    """Each GPU's trainer rank holds the whole model, more than its worker needs: cut locally."""
    case = AutoCase(_QWEN3, {"tp": 1, "divisor": 128}, ({}, {}), env)
    assert_bitwise(run(case), case.steps, "local")


def test_vocab_padding_that_differs_goes_through_the_exchange(env: dict[str, str]) -> None:
    """vocab 300: Megatron TP2 pads to 512 (rows 0-255 | 256-299), SGLang to 320 (rows 0-159 | 160-299):
    worker 1 needs rows 160-255 from GPU 0."""
    case = AutoCase({**_QWEN3, "vocab_size": 300}, {"tp": 2, "divisor": 128}, TP2, env)
    assert_bitwise(run(case), case.steps, "exchange")


def test_qwen3_moe_expert_tp2_to_tp2_engine_reads_locally(env: dict[str, str]) -> None:
    """Experts split by their intermediate size over TP on both sides (Megatron etp = tp, SGLang ep 1)."""
    ranks = ({"tp_rank": 0, "etp_rank": 0}, {"tp_rank": 1, "etp_rank": 1})
    case = AutoCase(_QWEN3_MOE, {"tp": 2, "divisor": 128}, ranks, env)
    assert_bitwise(run(case), case.steps, "local")


def test_a_gpu_without_a_trainer_record_fails_every_worker_naming_the_key(env: dict[str, str]) -> None:
    """GPU 1's trainer never writes its record: both workers give up after the step timeout with the key and
    who writes it; no step is applied on either, each writer's step fails with that reason, nobody hangs."""
    case = AutoCase(
        _QWEN3,
        {"tp": 2, "divisor": 128},
        TP2,
        {**env, "COLOCATE_STEP_TIMEOUT_SECONDS": "3"},
        steps=1,
        records_on=(0,),
    )
    results = run(case)
    key = "colocate:team-a:auto-job:trainer:"
    for rank, out in enumerate(results):
        assert out["path"] is None, f"worker {rank} kept a reader"  # the next update wires again
        failed = [m for m in out["log"] if "automatic colocated wiring failed on worker 1" in m]
        assert failed, f"worker {rank} logged: {out['log']}"
        assert key in failed[0] and "colocate_runtime.megatron" in failed[0], failed[0]
        # The trainer learns why from the step's error ACK, not from a timeout.
        assert len(out["errors"]) == 1 and "StepRejected" in out["errors"][0], out["errors"]
        assert "automatic colocated wiring failed on worker 1" in out["errors"][0], out["errors"]
    assert not any("worker 0:" in m for m in results[0]["log"] if "wiring failed" in m)
