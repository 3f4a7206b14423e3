"""colocate_runtime.megatron without a Megatron process: the layout rules (pure) and the agreement over a
real gloo group (two processes). The Publisher against real megatron-core and real SGLang runs in
tests/test_demo_megatron.py; its layout against every real Megatron case in tests/megatron_real."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate_devcluster.processes import free_port
from colocate_runtime.convert.errors import ConvertError, UnsupportedLayoutError
from colocate_runtime.convert.layout import MegatronLayout, MegatronRank, PipelineLayout
from colocate_runtime.convert.published import TrainerRecord
from colocate_runtime.convert.registry import model_spec
from colocate_runtime.convert.trainer import trainer_plan
from colocate_runtime.megatron.agree import Agreement, RankFailed
from colocate_runtime.megatron.parallel import ParallelState, layout_of, pipeline_of, vocab_divisor

QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 250,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
DEEPSEEK = {
    **QWEN3,
    "model_type": "deepseek_v3",
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def state(**kw: object) -> ParallelState:
    base = dict(tp=1, tp_rank=0, pp=1, pp_rank=0, ep=1, ep_rank=0, etp=1, etp_rank=0, vpp=1, num_layers=4)
    return ParallelState(**{**base, **kw})  # type: ignore[arg-type]


def test_pipeline_even_uneven_and_virtual() -> None:
    assert pipeline_of(state()) is None
    assert pipeline_of(state(pp=2)) == PipelineLayout.even(4, 2)
    assert pipeline_of(state(pp=2, vpp=2)) == PipelineLayout(((1, 1), (1, 1)))
    assert pipeline_of(state(pp=2, first_stage_layers=3)) == PipelineLayout(((3, 1),))


def test_custom_pipeline_layout_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedLayoutError, match="pipeline_model_parallel_layout"):
        pipeline_of(state(pp=2, custom_pipeline=True))


def test_vocab_divisor_reproduces_the_models_padded_vocabulary() -> None:
    chunk = torch.nn.Module()
    chunk.vocab_size = 384  # 250 padded to a multiple of 64 x 2 x 3 by some make_vocab_size_divisible_by
    st = state(tp=2)
    divisor = vocab_divisor(st, [chunk])
    spec = model_spec(QWEN3)
    rows = MegatronLayout(tp=2, vocab_divisor=divisor).groups(spec, MegatronRank()).embedding_rows
    assert rows == 384


def _tensors(plan_layout: MegatronLayout, rank: MegatronRank, spec_hf: dict) -> dict[str, torch.Tensor]:
    plan = trainer_plan(model_spec(spec_hf), plan_layout, rank)
    return {p.names[0]: torch.zeros(p.shape) for c in plan.chunks for p in c.params}


@pytest.mark.parametrize("split", [False, True])
def test_mla_down_projections_are_read_from_the_model(split: bool) -> None:
    rank = MegatronRank(tp_rank=1, etp_rank=1)
    held = _tensors(MegatronLayout(tp=2, mla_down_split=split), rank, DEEPSEEK)
    layout, got = layout_of(model_spec(DEEPSEEK), state(tp=2, tp_rank=1, etp=2, etp_rank=1), [held], 128)
    assert layout.mla_down_split is split and got == rank


def test_mla_down_projections_matching_neither_layout_name_both() -> None:
    held = _tensors(MegatronLayout(tp=2), MegatronRank(), DEEPSEEK)
    name = next(n for n in held if n.endswith("linear_kv_down_proj.weight"))
    held[name] = torch.zeros(7, 64)
    with pytest.raises(ConvertError, match=re.escape("match neither layout")) as err:
        layout_of(model_spec(DEEPSEEK), state(tp=2, etp=2), [held], 128)
    assert "(7, 64)" in str(err.value) and "local spec" in str(err.value)


def test_trainer_record_round_trips_and_refuses_another_version() -> None:
    record = TrainerRecord(
        MegatronLayout(tp=2, ep=2, pipeline=PipelineLayout.even(4, 2), mla_down_split=True),
        MegatronRank(1, 1, 1, 0),
        "bfloat16",
        "qwen3",
    )
    assert TrainerRecord.from_json(record.to_json()) == record
    with pytest.raises(ConvertError, match="same colocate_runtime"):
        TrainerRecord.from_json(record.to_json().replace('"version":1', '"version":99'))


def _agree(rank: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    agreement = Agreement(timeout_s=30)
    out: list[object] = []
    agreement.check("a phase everyone passes", None)
    try:
        agreement.check("publishing step 3", ValueError("disk full") if rank == 1 else None)
    except RankFailed as err:
        out.append((str(err), err.failed))
    dist.destroy_process_group()
    queue.put((rank, out))


def test_one_ranks_failure_fails_the_phase_on_every_rank_with_the_same_message() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agree, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0] == results[1]
    ((message, failed),) = results[0]
    assert message == "publishing step 3 failed on rank 1: ValueError: disk full"
    assert failed == {1: "ValueError: disk full"}


def test_an_offload_and_reload_of_a_buffer_is_seen_as_a_move() -> None:
    """Megatron's offload_to_cpu frees a DDP buffer's storage (resize to 0) and its reload allocates it again
    (the views stay valid): only the storage's address tells. A parameter whose data was swapped for another
    tensor is seen the same way."""
    from colocate_runtime.megatron.publisher import Publisher, storages_moved

    buffer = torch.zeros(1 << 16)
    param = torch.nn.Parameter(buffer[:100].view(10, 10))
    where = Publisher._addresses([{"a": param, "b": buffer[100:200]}])
    assert len(where) == 1 and not storages_moved(where)
    storage = buffer.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    blocker = torch.empty(nbytes, dtype=torch.uint8)  # takes the freed block: the reload lands elsewhere
    storage.resize_(nbytes)
    assert storages_moved(where)
    del blocker
    where = Publisher._addresses([{"a": param}])
    param.data = torch.ones(10, 10)
    assert storages_moved(where)


def test_parameters_whose_gather_megatron_deferred_are_synced_first() -> None:
    from colocate_runtime.megatron.publisher import sync_deferred_params

    class Chunk:
        def __init__(self, overlap: bool) -> None:
            self.ddp_config = type("DDPConfig", (), {"overlap_param_gather": overlap})()
            self.calls: list[dict] = []

        def start_param_sync(self, **kwargs: object) -> None:
            self.calls.append(kwargs)

    deferred, eager = Chunk(True), Chunk(False)
    sync_deferred_params([deferred, eager, torch.nn.Linear(2, 2)])
    assert deferred.calls == [{"force_sync": True}] and eager.calls == []
