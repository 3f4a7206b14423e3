"""Property-based round trips: splitting into shards and fusing back are inverse across TP / PP / EP sizes,
on the trainer side (Megatron layout -> canonical) and the inference side (canonical -> SGLang -> canonical),
with origin-encoded values so any misplaced element is caught."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colocate_runtime.convert import (
    ModelDims,
    SGLangLayout,
    canonical_tensors,
    fuse_query_groups,
    inference_plan,
    model_spec,
    split_query_groups,
    trainer_plan,
)
from tests.runtime.canonical_pieces import assemble, deliver, origin_tensors
from tests.runtime.megatron_layout import Parallel, layer_offset, megatron_chunks
from tests.runtime.sglang_layout import sglang_params

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    spec: ModelDims
    par: Parallel


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[Parallel, int]:
    """A valid Megatron pipeline (even, or uneven first/last stages; with or without virtual stages) and the
    layer count it holds."""
    pp, vpp = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    if pp == 1 or draw(st.booleans()):
        return Parallel(pp=pp, vpp=vpp), draw(st.integers(1, 2)) * pp * vpp
    first, last = draw(st.none() | st.integers(0, 2)), draw(st.none() | st.integers(0, 2))
    middle_ranks = pp - (first is not None) - (last is not None)
    row = [draw(st.integers(0, 2)) if middle_ranks else 0] * pp  # layers per chunk
    if first is not None:
        row[0] = first
    if last is not None:
        row[-1] = last
    assume(sum(row) > 0)

    def per_rank(per_chunk: int | None) -> int | None:
        return None if per_chunk is None else per_chunk * vpp

    return Parallel(pp=pp, vpp=vpp, first=per_rank(first), last=per_rank(last)), sum(row) * vpp


@st.composite
def models(draw: st.DrawFn, num_layers: int | None = None) -> ModelDims:
    kv = draw(st.sampled_from([1, 2, 4]))
    layers = num_layers or draw(st.integers(1, 4))
    experts = draw(st.sampled_from([0, 2, 4]))
    config = dict(
        model_type="qwen3_moe" if experts else "qwen3",
        hidden_size=draw(st.sampled_from([2, 4])),
        num_hidden_layers=layers,
        num_key_value_heads=kv,
        num_attention_heads=kv * draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([1, 2])),
        vocab_size=draw(st.integers(3, 20)),
        intermediate_size=8,
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        dtype="float64",
    )
    if experts:
        dense = draw(st.sets(st.integers(0, layers - 1), max_size=layers - 1))
        config.update(
            num_experts=experts,
            moe_intermediate_size=draw(st.sampled_from([2, 4])),
            mlp_only_layers=sorted(dense),
        )
    return model_spec(config)


@st.composite
def trainer_cases(draw: st.DrawFn) -> Case:
    pipeline, num_layers = draw(pipelines())
    spec = draw(models(num_layers))
    moe = spec.moe
    par = replace(
        pipeline,
        tp=draw(st.sampled_from([t for t in (1, 2, 4) if spec.num_kv_heads % t == 0])),
        ep=draw(st.sampled_from([e for e in (1, 2, 4) if moe is None or moe.num_experts % e == 0])),
        etp=draw(st.sampled_from([1, 2] if moe is not None and moe.intermediate_size % 2 == 0 else [1])),
        divisor=draw(st.sampled_from([1, 4, 8])),
        grouped_gemm=draw(st.booleans()),
    )
    return Case(spec, par)


@st.composite
def sglang_layouts(draw: st.DrawFn, spec: ModelDims) -> SGLangLayout:
    """SGLang layouts the model's shapes allow (KV heads are replicated when TP exceeds them)."""
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if spec.num_heads % t == 0]))
    moe = spec.moe
    eps = [
        e
        for e in (1, 2, 4, 8)
        if tp % e == 0
        and (moe is None or (moe.num_experts % e == 0 and moe.intermediate_size % (tp // e) == 0))
    ]
    assume(eps)
    return SGLangLayout(
        tp=tp,
        ep=draw(st.sampled_from(eps)),
        dp_attention=draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0])),
        dp_lm_head=draw(st.booleans()),
    )


def convert_all(spec: ModelDims, canonical: dict[str, torch.Tensor], par: Parallel) -> list:
    layout = par.layout(spec.num_layers)
    return [
        piece
        for rank in par.ranks()
        for piece in trainer_plan(spec, layout, rank).convert(megatron_chunks(spec, canonical, par, rank))
    ]


@SETTINGS
@given(trainer_cases())
def test_trainer_shards_fuse_back_to_the_canonical_model(case: Case) -> None:
    catalogue = canonical_tensors(case.spec)
    canonical = origin_tensors(catalogue)
    back = assemble(convert_all(case.spec, canonical, case.par), catalogue)
    for name, tensor in canonical.items():
        assert torch.equal(back[name], tensor), name


@SETTINGS
@given(st.data())
def test_sglang_split_and_read_back_are_inverse(data: st.DataObject) -> None:
    spec = data.draw(models())
    layout = data.draw(sglang_layouts(spec))
    catalogue = canonical_tensors(spec)
    canonical = origin_tensors(catalogue)
    whole = [(tensor.shard(), canonical[name]) for name, tensor in catalogue.items()]
    read_back = []
    for rank in layout.ranks():
        plan = inference_plan(spec, layout, rank)
        params = deliver(plan, whole)
        expected = sglang_params(spec, canonical, layout, rank)
        assert set(params) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), (rank, name)
        read_back += plan.read(params)
    back = assemble(read_back, catalogue)
    for name, tensor in canonical.items():
        assert torch.equal(back[name], tensor), name


@SETTINGS
@given(st.data())
def test_trainer_to_sglang_through_intersected_boxes(data: st.DataObject) -> None:
    """Trainer pieces cut the inference targets at arbitrary boundaries; writing the intersections fills every
    SGLang parameter exactly as SGLang's own loader would."""
    case = data.draw(trainer_cases())
    layout = data.draw(sglang_layouts(case.spec))
    canonical = origin_tensors(canonical_tensors(case.spec))
    pieces = convert_all(case.spec, canonical, case.par)
    for rank in layout.ranks():
        params = deliver(inference_plan(case.spec, layout, rank), pieces)
        for name, tensor in sglang_params(case.spec, canonical, layout, rank).items():
            assert torch.equal(params[name], tensor), (rank, name)


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.lists(st.integers(1, 3), max_size=2))
def test_query_group_split_and_fuse_are_inverse(
    groups: int, q_per_group: int, head_dim: int, trailing: list[int]
) -> None:
    rows = groups * (q_per_group + 2) * head_dim
    fused = torch.randn(rows, *trailing, dtype=torch.float64)
    q, k, v = split_query_groups(fused, groups, q_per_group, head_dim)
    assert q.shape[0] == groups * q_per_group * head_dim and k.shape[0] == v.shape[0] == groups * head_dim
    assert torch.equal(fuse_query_groups(q, k, v, groups), fused)
    again = split_query_groups(fuse_query_groups(q, k, v, groups), groups, q_per_group, head_dim)
    assert all(torch.equal(a, b) for a, b in zip(again, (q, k, v), strict=True))


@SETTINGS
@given(pipelines())
def test_pipeline_layout_matches_megatron_offset_formula(drawn: tuple[Parallel, int]) -> None:
    par, num_layers = drawn
    pipeline = par.layout(num_layers).pipeline
    assert pipeline is not None and pipeline.num_layers == num_layers
    seen = []
    for vp in range(par.vpp):
        for rank in range(par.pp):
            start, count = layer_offset(par, num_layers, rank, vp)
            assert pipeline.layers(rank, vp) == range(start, start + count), (rank, vp)
            seen += list(pipeline.layers(rank, vp))
    assert seen == list(range(num_layers))  # chunks in (virtual stage, pipeline rank) order tile the layers
