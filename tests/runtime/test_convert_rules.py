"""Each converter rule checked against its definition, with values that encode where they came from (part,
head, row, column, expert) and with the worked shapes of runtime_anchors.md section B."""

from __future__ import annotations

import pytest
import torch

from colocate_runtime.convert import (
    MegatronLayout,
    MegatronParam,
    MegatronRank,
    MissingTensorError,
    ModelDims,
    PipelineLayout,
    SGLangLayout,
    SGLangParam,
    ShapeMismatchError,
    TrainerRankPlan,
    canonical_tensors,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import Box
from tests.runtime.canonical_pieces import assemble, deliver, origin_tensors
from tests.runtime.megatron_layout import Parallel, megatron_chunks
from tests.runtime.sglang_layout import sglang_params

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    hidden_size=2048,
    num_hidden_layers=2,  # real models have more layers; per-layer shapes are the point here
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    dtype="bfloat16",
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    num_hidden_layers=4,
    num_attention_heads=128,
    vocab_size=129280,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    first_k_dense_replace=3,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    dtype="bfloat16",
)


def small_qwen3(**overrides: object) -> ModelDims:
    config = dict(
        model_type="qwen3",
        hidden_size=6,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=3,
        vocab_size=10,
        intermediate_size=8,
        dtype="float64",
        attention_bias=True,
    )
    return model_spec({**config, **overrides})


def small_bailing(**overrides: object) -> ModelDims:
    config = dict(
        model_type="bailing_moe",
        hidden_size=8,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
        vocab_size=20,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_experts=4,
        num_shared_experts=1,
        first_k_dense_replace=1,
        layer_group_size=2,
        use_qk_norm=True,
        moe_router_enable_expert_bias=True,
        router_dtype="fp32",
        dtype="float64",
    )
    return model_spec({**config, **overrides})


def megatron_param(plan: TrainerRankPlan, name: str) -> MegatronParam:
    return next(p for chunk in plan.chunks for p in chunk.params if p.names[0] == name)


def sglang_param(spec: ModelDims, layout: SGLangLayout, rank: int, name: str) -> SGLangParam:
    return next(p for p in inference_plan(spec, layout, rank).params if p.name == name)


def code(part: int, head: int, row: int, col: int = 0) -> float:
    return part * 10_000 + head * 100 + row * 10 + col


def grouped_qkv(spec: ModelDims, groups: range, with_cols: bool) -> torch.Tensor:
    """Megatron's linear_qkv by definition: per query group, its q heads, then its k head, then its v head;
    each element encodes (part, global head, row in head, column)."""
    qpg, d = spec.num_heads // spec.num_kv_heads, spec.head_dim
    cols = range(spec.hidden_size) if with_cols else range(1)
    rows = []
    for g in groups:
        heads = [(0, h) for h in range(g * qpg, (g + 1) * qpg)] + [(1, g), (2, g)]
        rows += [[code(part, h, r, c) for c in cols] for part, h in heads for r in range(d)]
    t = torch.tensor(rows, dtype=torch.float64)
    return t if with_cols else t[:, 0]


def expect_heads(data: torch.Tensor, part: int, first_row: int, head_dim: int) -> None:
    """Row i of a canonical q/k/v piece starting at `first_row` is head (first_row + i) // d, row % d."""
    for i in range(data.shape[0]):
        head, row = divmod(first_row + i, head_dim)
        cols = range(data.shape[1]) if data.ndim == 2 else [0]
        expected = torch.tensor([code(part, head, row, c) for c in cols], dtype=data.dtype)
        assert torch.equal(data[i] if data.ndim == 2 else data[i : i + 1], expected), (part, first_row + i)


@pytest.mark.parametrize("tp", [1, 2])
def test_gqa_split_takes_whole_query_groups_for_weight_and_bias(tp: int) -> None:
    spec = small_qwen3()
    d = spec.head_dim
    for tp_rank in range(tp):
        plan = trainer_plan(spec, MegatronLayout(tp=tp), MegatronRank(tp_rank=tp_rank))
        groups = range(tp_rank * 2 // tp, (tp_rank + 1) * 2 // tp)
        for suffix, with_cols in (("weight", True), ("bias", False)):
            param = megatron_param(plan, f"decoder.layers.0.self_attention.linear_qkv.{suffix}")
            fused = grouped_qkv(spec, groups, with_cols)
            assert param.shape == tuple(fused.shape)
            for part, piece in enumerate(param.pieces):
                assert piece.shard.name == f"model.layers.0.self_attn.{'qkv'[part]}_proj.{suffix}"
                data = piece.extract(fused)
                assert tuple(data.shape) == piece.shard.box.lengths
                heads_per_rank = (8 if part == 0 else 2) // tp
                assert piece.shard.box.offsets[0] == tp_rank * heads_per_rank * d
                expect_heads(data, part, piece.shard.box.offsets[0], d)


def test_mha_weight_and_bias_are_read_as_query_groups_not_as_q_k_v_thirds() -> None:
    """For MHA the grouped and the [Q; K; V] readings have the same size; Megatron stores groups."""
    spec = small_qwen3(num_key_value_heads=8)
    assert (
        spec.num_heads * spec.head_dim * 3 == (spec.queries_per_group + 2) * spec.head_dim * spec.num_kv_heads
    )
    plan = trainer_plan(spec, MegatronLayout(tp=2), MegatronRank(tp_rank=1))
    for suffix, with_cols in (("weight", True), ("bias", False)):
        param = megatron_param(plan, f"decoder.layers.1.self_attention.linear_qkv.{suffix}")
        fused = grouped_qkv(spec, range(4, 8), with_cols)
        for part, piece in enumerate(param.pieces):
            assert piece.shard.box.offsets[0] == 4 * spec.head_dim
            expect_heads(piece.extract(fused), part, piece.shard.box.offsets[0], spec.head_dim)


def test_qwen3_30b_a3b_worked_shapes() -> None:
    spec = model_spec(QWEN3_30B_A3B)
    one = trainer_plan(spec, MegatronLayout(tp=1), MegatronRank())
    qkv = megatron_param(one, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.shape == (5120, 2048)
    assert [p.shard.box.lengths for p in qkv.pieces] == [(4096, 2048), (512, 2048), (512, 2048)]
    for tp_rank in range(2):
        plan = trainer_plan(spec, MegatronLayout(tp=2), MegatronRank(tp_rank=tp_rank))
        qkv = megatron_param(plan, "decoder.layers.0.self_attention.linear_qkv.weight")
        assert qkv.shape == (2560, 2048)
        assert [p.shard.box for p in qkv.pieces] == [
            Box((tp_rank * 2048, 0), (2048, 2048)),
            Box((tp_rank * 256, 0), (256, 2048)),
            Box((tp_rank * 256, 0), (256, 2048)),
        ]
    # SGLang TP 8 > 4 KV heads: each rank holds 4 q heads and one replicated KV head, KV head = rank // 2.
    for tp_rank in range(8):
        param = sglang_param(spec, SGLangLayout(tp=8), tp_rank, "model.layers.0.self_attn.qkv_proj.weight")
        assert param.shape == (768, 2048)
        q, k, v = param.placements
        assert (q.shard.box.offsets[0], q.offsets[0]) == (tp_rank * 512, 0)
        assert (k.shard.box, k.offsets[0]) == (Box(((tp_rank // 2) * 128, 0), (128, 2048)), 512)
        assert (v.shard.box, v.offsets[0]) == (Box(((tp_rank // 2) * 128, 0), (128, 2048)), 640)


def test_mla_fused_qkv_a_is_the_plain_concatenation_on_every_rank() -> None:
    spec = model_spec(DEEPSEEK_V3)
    for tp_rank in range(4):
        fused = sglang_param(
            spec, SGLangLayout(tp=4), tp_rank, "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
        )
        assert fused.shape == (2112, 7168)
        q_a, kv_a = fused.placements
        assert (q_a.shard.name, q_a.shard.box, q_a.offsets) == (
            "model.layers.0.self_attn.q_a_proj.weight",
            Box((0, 0), (1536, 7168)),
            (0, 0),
        )
        assert (kv_a.shard.name, kv_a.shard.box, kv_a.offsets) == (
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            Box((0, 0), (576, 7168)),
            (1536, 0),
        )
    for tp_rank in range(2):  # Megatron duplicates the down projections on every TP rank
        plan = trainer_plan(
            spec,
            MegatronLayout(tp=2, ep=8, pipeline=PipelineLayout.uneven(4, 2, first=1)),
            MegatronRank(tp_rank=tp_rank),
        )
        down = megatron_param(plan, "decoder.layers.0.self_attention.linear_q_down_proj.weight")
        assert down.shape == (1536, 7168) and down.pieces[0].shard.box == Box.full((1536, 7168))
        up = megatron_param(plan, "decoder.layers.0.self_attention.linear_q_up_proj.weight")
        assert up.pieces[0].shard.box == Box((tp_rank * 64 * 192, 0), (64 * 192, 1536))


def tiny_deepseek(dtype: str = "float64", q_lora_rank: int | None = 6) -> ModelDims:
    return model_spec(
        dict(
            model_type="deepseek_v3",
            hidden_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=12,
            intermediate_size=8,
            moe_intermediate_size=4,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=4,
            qk_rope_head_dim=2,
            qk_nope_head_dim=2,
            v_head_dim=2,
            dtype=dtype,
        )
    )


def trainer_pieces(spec: ModelDims, canonical: dict[str, torch.Tensor], par: Parallel) -> list:
    layout = par.layout(spec.num_layers)
    return [
        piece
        for rank in par.ranks()
        for piece in trainer_plan(spec, layout, rank).convert(megatron_chunks(spec, canonical, par, rank))
    ]


def test_mla_fused_qkv_a_values_reach_every_sglang_rank_whole() -> None:
    spec = tiny_deepseek()
    canonical = origin_tensors(canonical_tensors(spec))
    pieces = trainer_pieces(spec, canonical, Parallel(tp=2, ep=2))
    plain = torch.cat(
        [
            canonical["model.layers.1.self_attn.q_a_proj.weight"],
            canonical["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
        ]
    )
    for tp_rank in range(4):
        params = deliver(inference_plan(spec, SGLangLayout(tp=4), tp_rank), pieces)
        assert torch.equal(params["model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"], plain)


def test_mla_without_query_compression_keeps_kv_a_unfused() -> None:
    spec = tiny_deepseek(q_lora_rank=None)
    canonical = origin_tensors(canonical_tensors(spec))
    assert "model.layers.0.self_attn.q_proj.weight" in canonical
    pieces = trainer_pieces(spec, canonical, Parallel(tp=2, ep=2))
    layout = SGLangLayout(tp=4, ep=2)
    for tp_rank in range(4):
        params = deliver(inference_plan(spec, layout, tp_rank), pieces)
        expected = sglang_params(spec, canonical, layout, tp_rank)
        assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" not in params
        assert set(params) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), (tp_rank, name)


def test_mla_down_projection_split_by_tp_is_rejected() -> None:
    spec = tiny_deepseek()
    canonical = origin_tensors(canonical_tensors(spec))
    par = Parallel(tp=2)
    chunks = megatron_chunks(spec, canonical, par, MegatronRank(tp_rank=0))
    name = "decoder.layers.0.self_attention.linear_q_down_proj.weight"
    chunks[0][name] = chunks[0][name][:3]  # a build that column-splits it would hold 6 / 2 rows
    with pytest.raises(ShapeMismatchError, match="linear_q_down_proj"):
        trainer_plan(spec, par.layout(2), MegatronRank(tp_rank=0)).convert(chunks)


def test_lightning_query_key_value_is_tp_sharded_and_feeds_every_sglang_rank() -> None:
    spec = small_bailing()
    assert spec.linear_attention_layers == frozenset({0, 2})
    assert spec.output_dtype == "float32"  # linear-attention Bailing keeps lm_head in fp32
    catalogue = canonical_tensors(spec)
    assert "model.layers.0.attention.g_norm.weight" in catalogue
    assert catalogue["model.layers.0.attention.g_norm.weight"].shape == (8,)  # 1-D, as SGLang holds it
    canonical = {n: t.to(torch_dtype(catalogue[n].dtype)) for n, t in origin_tensors(catalogue).items()}
    par = Parallel(tp=2, ep=2)
    for tp_rank in range(2):
        plan = trainer_plan(spec, par.layout(4), MegatronRank(tp_rank=tp_rank))
        qkv = megatron_param(plan, "decoder.layers.0.self_attention.linear_qkv.weight")
        assert [p.shard.box.offsets[0] for p in qkv.pieces] == [tp_rank * 4, tp_rank * 2, tp_rank * 2]
        gate_norm = megatron_param(plan, "decoder.layers.0.self_attention.gate_norm.weight")
        assert gate_norm.pieces[0].shard.box == Box((tp_rank * 4,), (4,))
    pieces = trainer_pieces(spec, canonical, par)
    layout = SGLangLayout(tp=4)
    for tp_rank in range(4):
        params = deliver(inference_plan(spec, layout, tp_rank), pieces)
        expected = sglang_params(
            spec, canonical, layout, tp_rank, embedding_name="model.word_embeddings.weight"
        )
        fused = params["model.layers.0.attention.query_key_value.weight"]
        assert bool((fused != 0).all()), f"rank {tp_rank} left part of query_key_value unfilled"
        assert torch.equal(fused, expected["model.layers.0.attention.query_key_value.weight"])
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), (tp_rank, name)


def test_embedding_renamed_keeps_embedding_sharding() -> None:
    """Bailing's SGLang parameter is `model.word_embeddings`; it is still a vocab-parallel embedding,
    replicated under DP attention, exactly like Qwen3's `model.embed_tokens`."""
    for spec, sglang_name in (
        (small_bailing(), "model.word_embeddings.weight"),
        (small_qwen3(), "model.embed_tokens.weight"),
    ):
        assert "model.embed_tokens.weight" in canonical_tensors(spec)
        for tp_rank in range(4):
            split = sglang_param(spec, SGLangLayout(tp=4), tp_rank, sglang_name)
            assert split.shape == (16, spec.hidden_size)
            boxes = [p.shard.box for p in split.placements]
            assert all(p.shard.name == "model.embed_tokens.weight" for p in split.placements)
            real = max(0, min(16, spec.vocab_size - 16 * tp_rank))
            assert boxes == ([Box((16 * tp_rank, 0), (real, spec.hidden_size))] if real else [])
            replicated = sglang_param(spec, SGLangLayout(tp=4, dp_attention=2), tp_rank, sglang_name)
            assert [p.shard.box for p in replicated.placements] == [
                Box.full((spec.vocab_size, spec.hidden_size))
            ]


def test_vocab_padding_is_trimmed_on_both_sides() -> None:
    spec = model_spec(QWEN3_30B_A3B)
    boxes = []
    for tp_rank in range(2):
        plan = trainer_plan(spec, MegatronLayout(tp=2), MegatronRank(tp_rank=tp_rank))
        embedding = megatron_param(plan, "embedding.word_embeddings.weight")
        assert embedding.shape == (76032, 2048)  # 152064 padded rows (multiple of 128 * 2) / 2
        boxes.append(embedding.pieces[0].shard.box)
    assert boxes == [Box((0, 0), (76032, 2048)), Box((76032, 0), (75904, 2048))]
    head = sglang_param(spec, SGLangLayout(tp=8), 7, "lm_head.weight")
    assert head.shape == (18992, 2048) and head.placements[0].shard.box == Box((7 * 18992, 0), (18992, 2048))
    # A rank that holds only padding sends and receives nothing.
    tiny = small_qwen3(vocab_size=10, num_key_value_heads=4)
    plan = trainer_plan(tiny, MegatronLayout(tp=4, vocab_divisor=8), MegatronRank(tp_rank=3))
    assert megatron_param(plan, "embedding.word_embeddings.weight").pieces == ()
    assert sglang_param(tiny, SGLangLayout(tp=4), 1, "model.embed_tokens.weight").placements == ()


def test_padding_rows_never_reach_the_canonical_tensors() -> None:
    spec = small_qwen3(vocab_size=13)
    catalogue = canonical_tensors(spec)
    canonical = origin_tensors(catalogue)
    par = Parallel(tp=2, pp=2, divisor=4)  # 13 -> 16 rows with NaN padding
    back = assemble(trainer_pieces(spec, canonical, par), catalogue)
    assert not torch.isnan(back["model.embed_tokens.weight"]).any()
    assert torch.equal(back["lm_head.weight"], canonical["lm_head.weight"])


def test_tied_embeddings_have_one_canonical_tensor() -> None:
    spec = small_qwen3(tie_word_embeddings=True)
    catalogue = canonical_tensors(spec)
    assert "lm_head.weight" not in catalogue
    assert all(p.name != "lm_head.weight" for p in inference_plan(spec, SGLangLayout(tp=2), 0).params)
    canonical = origin_tensors(catalogue)
    for par in (Parallel(pp=2), Parallel()):  # the last stage's output_layer copy is dropped; none with PP 1
        back = assemble(trainer_pieces(spec, canonical, par), catalogue)
        assert torch.equal(back["model.embed_tokens.weight"], canonical["model.embed_tokens.weight"])
    untied = small_qwen3()
    chunks = megatron_chunks(untied, origin_tensors(canonical_tensors(untied)), Parallel(), MegatronRank())
    del chunks[0]["output_layer.weight"]
    with pytest.raises(MissingTensorError, match=r"output_layer\.weight"):
        trainer_plan(untied, Parallel().layout(2), MegatronRank()).convert(chunks)


def small_qwen3_moe(num_experts: int = 8, dtype: str = "float64") -> ModelDims:
    return model_spec(
        dict(
            model_type="qwen3_moe",
            hidden_size=4,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=2,
            vocab_size=8,
            intermediate_size=8,
            moe_intermediate_size=4,
            num_experts=num_experts,
            dtype=dtype,
        )
    )


def test_expert_ids_are_global_on_both_sides() -> None:
    spec = small_qwen3_moe()
    for naming, grouped in ((0, False), (1, True)):
        plan = trainer_plan(spec, MegatronLayout(ep=4, etp=1), MegatronRank(ep_rank=2))
        fc1 = [p for p in plan.chunks[0].params if "linear_fc1" in p.names[0] and "experts" in p.names[0]]
        layer0 = [p for p in fc1 if p.names[0].startswith("decoder.layers.0.")]
        assert len(layer0) == 2
        for local, param in enumerate(layer0):
            stem = "decoder.layers.0.mlp.experts."
            assert param.names[naming] == (
                stem + f"linear_fc1.weight{local}"
                if grouped
                else stem + f"local_experts.{local}.linear_fc1.weight"
            )
            assert [p.shard.name for p in param.pieces] == [
                f"model.layers.0.mlp.experts.{4 + local}.gate_proj.weight",
                f"model.layers.0.mlp.experts.{4 + local}.up_proj.weight",
            ]
    # SGLang, as pinned by the seed: 4 experts, ep 2, ep rank 1 holds experts 2 and 3.
    four = small_qwen3_moe(num_experts=4)
    w13 = sglang_param(four, SGLangLayout(tp=2, ep=2), 1, "model.layers.0.mlp.experts.w13_weight")
    assert [(p.index, p.shard.name.split(".")[5]) for p in w13.placements] == [
        ((0,), "2"),
        ((0,), "2"),
        ((1,), "3"),
        ((1,), "3"),
    ]


def test_w13_halves_are_gate_then_up_and_w2_is_down() -> None:
    spec = small_qwen3_moe()
    catalogue = canonical_tensors(spec)
    canonical = origin_tensors(catalogue)
    pieces = trainer_pieces(spec, canonical, Parallel(ep=4, etp=2))
    layout = SGLangLayout(tp=4, ep=2)  # moe tp 2: rank 3 is ep rank 1, expert-tp rank 1
    params = deliver(inference_plan(spec, layout, 3), pieces)
    w13, w2 = params["model.layers.1.mlp.experts.w13_weight"], params["model.layers.1.mlp.experts.w2_weight"]
    assert w13.shape == (4, 4, 4) and w2.shape == (4, 4, 2)
    for local in range(4):
        expert = 4 + local
        gate = canonical[f"model.layers.1.mlp.experts.{expert}.gate_proj.weight"]
        up = canonical[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"]
        down = canonical[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"]
        assert torch.equal(w13[local, :2], gate[2:]) and torch.equal(w13[local, 2:], up[2:])
        assert torch.equal(w2[local], down[:, 2:])


def test_expert_bias_travels_as_fp32_and_keeps_small_updates() -> None:
    spec = tiny_deepseek(dtype="bfloat16")
    catalogue = canonical_tensors(spec)
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert catalogue[bias_name].dtype == "float32"
    canonical = {n: torch.zeros(t.shape, dtype=torch_dtype(t.dtype)) for n, t in catalogue.items()}
    canonical[bias_name] = torch.full((4,), 1 + 2**-12, dtype=torch.float32)  # bf16 would round it to 1
    pieces = trainer_pieces(spec, canonical, Parallel(tp=2))
    bias = [data for shard, data in pieces if shard.name == bias_name]
    assert bias and all(d.dtype == torch.float32 and bool((d == 1 + 2**-12).all()) for d in bias)


def test_router_dtype_is_configurable_and_defaults_to_the_model_dtype() -> None:
    assert small_bailing().router_dtype == "float32"  # Bailing configs say router_dtype: fp32
    spec = small_qwen3_moe(dtype="bfloat16")
    assert spec.router_dtype == "bfloat16"
    fp32 = model_spec(dict(QWEN3_30B_A3B, num_hidden_layers=1), router_dtype="float32")
    assert canonical_tensors(fp32)["model.layers.0.mlp.gate.weight"].dtype == "float32"
    assert canonical_tensors(fp32)["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == "bfloat16"
    tiny = model_spec(
        dict(
            model_type="qwen3_moe",
            hidden_size=4,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=2,
            vocab_size=8,
            intermediate_size=8,
            moe_intermediate_size=4,
            num_experts=2,
            dtype="bfloat16",
        ),
        router_dtype="fp32",
    )
    catalogue = canonical_tensors(tiny)
    canonical = {n: torch.ones(t.shape, dtype=torch.bfloat16) for n, t in catalogue.items()}
    for shard, data in trainer_pieces(tiny, canonical, Parallel()):
        assert data.dtype == (torch.float32 if shard.name.endswith("mlp.gate.weight") else torch.bfloat16)


@pytest.mark.parametrize(
    ("pipeline", "pp_rank", "vp_stage", "layers"),
    [
        (PipelineLayout.uneven(7, 3, first=1, last=2), 0, 0, range(0, 1)),
        (PipelineLayout.uneven(7, 3, first=1, last=2), 1, 0, range(1, 5)),
        (PipelineLayout.uneven(7, 3, first=1, last=2), 2, 0, range(5, 7)),
        (PipelineLayout.even(8, 2, vpp=2), 1, 0, range(2, 4)),
        (PipelineLayout.even(8, 2, vpp=2), 0, 1, range(4, 6)),
        (PipelineLayout.even(8, 2, vpp=2), 1, 1, range(6, 8)),
        (PipelineLayout.uneven(10, 3, first=2, last=2, vpp=2), 1, 0, range(1, 4)),
        (PipelineLayout.uneven(10, 3, first=2, last=2, vpp=2), 0, 1, range(5, 6)),
        (PipelineLayout.uneven(10, 3, first=2, last=2, vpp=2), 2, 1, range(9, 10)),
    ],
)
def test_pipeline_chunks_renumber_local_layers(
    pipeline: PipelineLayout, pp_rank: int, vp_stage: int, layers: range
) -> None:
    spec = small_qwen3(num_hidden_layers=pipeline.num_layers)
    plan = trainer_plan(spec, MegatronLayout(pipeline=pipeline), MegatronRank(pp_rank=pp_rank))
    chunk = plan.chunks[vp_stage]
    assert chunk.layers == layers
    for local, layer in enumerate(layers):
        name = f"decoder.layers.{local}.self_attention.linear_proj.weight"
        param = next(p for p in chunk.params if p.names[0] == name)
        assert param.pieces[0].shard.name == f"model.layers.{layer}.self_attn.o_proj.weight"
    names = {p.names[0] for p in chunk.params}
    assert ("embedding.word_embeddings.weight" in names) == (pp_rank == 0 and vp_stage == 0)
    assert ("output_layer.weight" in names) == (pp_rank == pipeline.pp - 1 and vp_stage == pipeline.vpp - 1)
