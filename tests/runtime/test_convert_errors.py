"""Clear errors instead of silent corruption: unknown architecture, missing / unexpected tensors, shape
mismatches, unsupported layouts, and misuse of the inference writer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from colocate_runtime.convert import (
    ConvertError,
    MegatronLayout,
    MegatronRank,
    MissingTensorError,
    ModelDims,
    PipelineLayout,
    SGLangLayout,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    UnsupportedLayoutError,
    architecture,
    canonical_tensors,
    inference_plan,
    model_spec,
    register,
    trainer_plan,
)
from colocate_runtime.shards import Box, ShardError, TensorShard
from tests.runtime.canonical_pieces import origin_tensors
from tests.runtime.megatron_layout import Parallel, megatron_chunks

CONFIG = dict(
    model_type="qwen3_moe",
    hidden_size=8,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=2,
    vocab_size=30,
    intermediate_size=8,
    moe_intermediate_size=4,
    num_experts=8,
    dtype="float32",
)


@pytest.fixture(scope="module")
def spec() -> ModelDims:
    return model_spec(CONFIG)


@pytest.fixture(scope="module")
def canonical(spec: ModelDims) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in origin_tensors(canonical_tensors(spec)).items()}


def test_unknown_architecture(spec: ModelDims) -> None:
    with pytest.raises(UnknownArchitectureError, match=r"'llama'.*qwen3_moe"):
        architecture("llama")
    with pytest.raises(UnknownArchitectureError, match="gpt2"):
        model_spec({**CONFIG, "model_type": "gpt2"})
    with pytest.raises(UnknownArchitectureError, match="mamba"):
        trainer_plan(replace(spec, architecture="mamba"), MegatronLayout(), MegatronRank())
    with pytest.raises(ConvertError, match="already registered"):
        register(replace(architecture("qwen3"), layer=lambda spec, layer: []))


def test_config_without_a_required_field() -> None:
    config = dict(CONFIG)
    del config["moe_intermediate_size"]
    with pytest.raises(ConvertError, match="moe_intermediate_size"):
        model_spec(config)


def test_bailing_normalised_lm_head_is_refused() -> None:
    config = dict(
        model_type="bailing_moe",
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=20,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_experts=4,
        norm_head=True,
    )
    with pytest.raises(UnsupportedLayoutError, match="norm_head"):
        model_spec(config)


def test_missing_tensor_is_named(spec: ModelDims, canonical: dict[str, torch.Tensor]) -> None:
    par = Parallel(tp=2, pp=2)
    chunks = megatron_chunks(spec, canonical, par, MegatronRank(tp_rank=1, pp_rank=1))
    del chunks[0]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
    del chunks[0]["decoder.final_layernorm.weight"]
    plan = trainer_plan(spec, par.layout(4), MegatronRank(tp_rank=1, pp_rank=1))
    with pytest.raises(
        MissingTensorError, match=r"2 expected.*local_experts\.3\.linear_fc2.*final_layernorm"
    ):
        plan.convert(chunks)


def test_unexpected_tensor_is_named_and_wrappers_are_tolerated(
    spec: ModelDims, canonical: dict[str, torch.Tensor]
) -> None:
    plan = trainer_plan(spec, Parallel().layout(4), MegatronRank())
    (chunk,) = megatron_chunks(spec, canonical, Parallel(), MegatronRank())
    # DDP / Float16Module prefixes and Transformer Engine's _extra_state are part of real state dicts.
    wrapped = {f"module.module.{name}": t for name, t in chunk.items()}
    wrapped["module.decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.empty(0)
    assert len(plan.convert(wrapped)) == len(plan.shards())
    legacy = dict(chunk, **{"decoder.layers.0.mlp.experts.weight1": torch.zeros(8, 64)})  # legacy GroupedMLP
    with pytest.raises(UnexpectedTensorError, match=r"experts\.weight1"):
        plan.convert(legacy)


def test_shape_mismatch_names_tensor_and_shapes(spec: ModelDims, canonical: dict[str, torch.Tensor]) -> None:
    (chunk,) = megatron_chunks(spec, canonical, Parallel(tp=1), MegatronRank())
    plan = trainer_plan(spec, MegatronLayout(tp=2), MegatronRank(tp_rank=0))  # TP 1 tensors, TP 2 plan
    with pytest.raises(ShapeMismatchError, match=r"expected local shape \(\d+, 8\), got \(\d+, 8\)"):
        plan.convert(chunk)


def test_wrong_number_of_model_chunks(spec: ModelDims, canonical: dict[str, torch.Tensor]) -> None:
    par = Parallel(pp=2, vpp=2)
    chunks = megatron_chunks(spec, canonical, par, MegatronRank())
    with pytest.raises(ConvertError, match="1 model chunk"):
        trainer_plan(spec, par.layout(4), MegatronRank()).convert(chunks[0])


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (MegatronLayout(tp=4), "2 KV heads do not split over attention TP 4"),
        (MegatronLayout(ep=3), "8 experts do not split over expert parallel 3"),
        (MegatronLayout(etp=8), "does not split over 8 ranks"),
        (MegatronLayout(pipeline=PipelineLayout.even(3)), "holds 3 layers, the model has 4"),
    ],
)
def test_unsupported_trainer_layouts(spec: ModelDims, layout: MegatronLayout, match: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=match):
        for rank in layout.ranks():
            trainer_plan(spec, layout, rank)


def test_unsupported_pipeline_splits() -> None:
    with pytest.raises(UnsupportedLayoutError, match="do not split evenly"):
        PipelineLayout.even(5, 2)
    assert PipelineLayout.uneven(10, 3, first=1, last=2).layer_counts == ((1, 7, 2),)
    with pytest.raises(
        UnsupportedLayoutError, match=r"7 layers do not split evenly over 1 pipeline rank\(s\) x 2"
    ):
        PipelineLayout.uneven(10, 3, first=1, last=2, vpp=2)
    with pytest.raises(UnsupportedLayoutError, match=r"more than 1 pipeline rank"):
        PipelineLayout.uneven(4, 1, last=4)


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (SGLangLayout(tp=3), "64 padded rows do not split over 3 ranks"),
        (SGLangLayout(tp=16), "8 heads cannot be split over attention TP 16"),
    ],
)
def test_unsupported_inference_layouts(spec: ModelDims, layout: SGLangLayout, match: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=match):
        for rank in layout.ranks():
            inference_plan(spec, layout, rank)


def test_kv_heads_neither_divided_nor_replicated(spec: ModelDims) -> None:
    odd = replace(spec, num_heads=12, num_kv_heads=3)
    with pytest.raises(
        UnsupportedLayoutError, match=r"3 heads cannot be split over attention TP 4 .*multiple of"
    ):
        inference_plan(odd, SGLangLayout(tp=4), 0)


def test_sglang_layout_is_validated_on_construction() -> None:
    with pytest.raises(UnsupportedLayoutError, match="ep size 8 does not divide tp 4"):
        SGLangLayout(tp=4, ep=8)
    with pytest.raises(UnsupportedLayoutError, match="dp_attention size 3 does not divide tp 4"):
        SGLangLayout(tp=4, dp_attention=3)


def test_inference_tp_above_kv_heads_replicates_instead_of_failing(spec: ModelDims) -> None:
    boxes = [
        next(
            s.box
            for s in inference_plan(spec, SGLangLayout(tp=8, ep=8), r).shards()
            if s.name.endswith("0.self_attn.k_proj.weight")
        )
        for r in range(8)
    ]
    assert boxes == [Box((r // 4 * 2, 0), (2, 8)) for r in range(8)]


def test_inference_writer_rejects_what_the_rank_does_not_hold(spec: ModelDims) -> None:
    plan = inference_plan(spec, SGLangLayout(tp=2, ep=2), 1)  # holds experts 4..7
    params = {name: torch.zeros(shape) for name, shape in plan.param_shapes().items()}
    plan.check(params)
    target = next(s for s in plan.shards() if s.name == "model.layers.0.self_attn.q_proj.weight")
    assert target.box == Box((8, 0), (8, 8))
    outside = TensorShard(target.name, target.global_shape, target.dtype, Box((0, 0), (8, 8)))
    with pytest.raises(ShardError, match="outside this rank's box"):
        plan.write(params, outside, torch.zeros(8, 8))
    with pytest.raises(ShapeMismatchError, match="data for box"):
        plan.write(params, target, torch.zeros(4, 8))
    with pytest.raises(ConvertError, match=r"holds no part of model\.layers\.0\.mlp\.experts\.0"):
        plan.write(
            params,
            TensorShard(
                "model.layers.0.mlp.experts.0.gate_proj.weight", (4, 8), "float32", Box((0, 0), (4, 8))
            ),
            torch.zeros(4, 8),
        )
    params["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(10, 8)
    with pytest.raises(ShapeMismatchError, match="qkv_proj"):
        plan.check(params)
    del params["model.norm.weight"]
    with pytest.raises(MissingTensorError, match=r"model\.norm\.weight"):
        plan.check(params)
