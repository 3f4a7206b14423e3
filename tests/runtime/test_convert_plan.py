"""The converters' metadata is what the transfer-plan builder consumes: trainer sources and SGLang targets as
`RankShards`, planned by `colocate_runtime.p2p.build_plan`, then executed on CPU tensors with the converters'
pieces and the inference writer. The result equals SGLang's own layout of the same weights."""

from __future__ import annotations

import pytest
import torch

from colocate_runtime.convert import SGLangLayout, canonical_tensors, inference_plan, model_spec, trainer_plan
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.p2p import Layout, build_plan
from colocate_runtime.shards import TensorShard
from tests.runtime.canonical_pieces import origin_tensors
from tests.runtime.megatron_layout import Parallel, megatron_chunks
from tests.runtime.sglang_layout import sglang_params

SPEC = model_spec(
    dict(
        model_type="qwen3_moe",
        hidden_size=8,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=2,
        vocab_size=27,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_experts=4,
        mlp_only_layers=[0],
        dtype="float32",
        router_dtype="float32",
    )
)


@pytest.mark.parametrize(
    ("par", "layout"),
    [
        (Parallel(tp=2, pp=2, ep=2, etp=1, divisor=4), SGLangLayout(tp=4)),
        (Parallel(tp=1, pp=2, vpp=2, ep=4), SGLangLayout(tp=8, ep=2, dp_attention=2)),
        (Parallel(tp=2, pp=1, ep=2, etp=2), SGLangLayout(tp=2, ep=2)),
    ],
)
@pytest.mark.parametrize("batched", [False, True], ids=["write", "write_many"])
def test_plan_from_converter_metadata_fills_sglang_parameters(
    par: Parallel, layout: SGLangLayout, batched: bool
) -> None:
    catalogue = canonical_tensors(SPEC)
    canonical = {name: t.float() for name, t in origin_tensors(catalogue).items()}
    megatron = par.layout(SPEC.num_layers)
    trainer_ranks = list(par.ranks())
    sources, held = [], {}
    for rank_id, rank in enumerate(trainer_ranks):
        plan = trainer_plan(SPEC, megatron, rank)
        sources.append(plan.rank_shards(rank_id))
        held[rank_id] = {
            shard.name: data for shard, data in plan.convert(megatron_chunks(SPEC, canonical, par, rank))
        }
    first_target = len(trainer_ranks)
    plans = {first_target + r: inference_plan(SPEC, layout, r) for r in layout.ranks()}
    targets = [p.rank_shards(rank_id) for rank_id, p in plans.items()]

    transfer_plan = build_plan(Layout.from_ranks(sources), Layout.from_ranks(targets))

    params = {
        rank_id: {n: torch.zeros(shape) for n, shape in p.param_shapes().items()}
        for rank_id, p in plans.items()
    }
    received: dict[int, list] = {rank_id: [] for rank_id in plans}
    for t in transfer_plan.transfers:
        piece = held[t.src][t.name][t.src_box.slices()]
        shard = TensorShard(t.name, catalogue[t.name].shape, t.dst_dtype, t.region)
        received[t.dst].append((shard, piece.to(torch_dtype(t.dst_dtype))))
    for rank_id, pieces in received.items():
        if batched:
            plans[rank_id].write_many(params[rank_id], pieces)
        else:
            for shard, data in pieces:
                plans[rank_id].write(params[rank_id], shard, data)
    for rank_id, p in plans.items():
        expected = sglang_params(SPEC, canonical, layout, p.tp_rank)
        for name, tensor in expected.items():
            assert torch.equal(params[rank_id][name], tensor), (p.tp_rank, name)
