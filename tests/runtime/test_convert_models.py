"""Real models end to end: tiny Qwen3, Qwen3-MoE and DeepSeek-V3 built by transformers (random init, CPU),
put into Megatron-core layout by an independent helper, sharded several ways, converted back by the
converters, delivered into SGLang-layout parameters, read back and loaded: logits equal the original's."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from colocate_runtime.convert import (
    CanonicalTensor,
    ModelDims,
    SGLangLayout,
    canonical_tensors,
    inference_plan,
    model_spec,
    trainer_plan,
)
from tests.runtime.canonical_pieces import assemble, deliver
from tests.runtime.megatron_layout import Parallel, megatron_chunks
from tests.runtime.sglang_layout import sglang_params

FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


@dataclass
class Toy:
    model_class: type[PreTrainedModel]
    config: PretrainedConfig
    spec: ModelDims
    catalogue: dict[str, CanonicalTensor]
    canonical: dict[str, torch.Tensor]
    inputs: torch.Tensor
    logits: torch.Tensor


def hf_to_canonical(model: PreTrainedModel, spec: ModelDims) -> dict[str, torch.Tensor]:
    """transformers 5 stacks experts ([E, 2I, H] gate then up; [E, H, I]); canonical form is per expert."""
    out = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone()
        if match := FUSED_EXPERTS.fullmatch(name):
            for e in range(tensor.shape[0]):
                stem = f"{match[1]}.{e}"
                if match[2] == "down_proj":
                    out[f"{stem}.down_proj.weight"] = tensor[e].clone()
                else:
                    gate, up = tensor[e].chunk(2)
                    out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = gate.clone(), up.clone()
        elif not (name == "lm_head.weight" and spec.tie_word_embeddings):
            out[name] = tensor
    return out


def canonical_to_hf(canonical: dict[str, torch.Tensor], spec: ModelDims) -> dict[str, torch.Tensor]:
    out = dict(canonical)
    if spec.moe is not None:
        for layer in sorted(spec.moe.layers):
            stem = f"model.layers.{layer}.mlp.experts"
            experts = range(spec.moe.num_experts)
            gate_up = [
                torch.cat([out.pop(f"{stem}.{e}.gate_proj.weight"), out.pop(f"{stem}.{e}.up_proj.weight")])
                for e in experts
            ]
            out[f"{stem}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{stem}.down_proj"] = torch.stack([out.pop(f"{stem}.{e}.down_proj.weight") for e in experts])
    if spec.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def logits_with(toy: Toy, canonical: dict[str, torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(1)  # the weights all come from `canonical`; the seed only fixes anything left unset
    model = toy.model_class(toy.config).eval()
    model.load_state_dict(canonical_to_hf(canonical, toy.spec), strict=True)
    with torch.no_grad():
        return model(toy.inputs).logits


def build(model_class: type[PreTrainedModel], config: PretrainedConfig) -> Toy:
    torch.manual_seed(0)
    model = model_class(config).eval()
    spec = model_spec(config.to_dict(), dtype="float32")
    canonical = hf_to_canonical(model, spec)
    inputs = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        logits = model(inputs).logits
    return Toy(model_class, config, spec, canonical_tensors(spec), canonical, inputs, logits)


SMALL = dict(vocab_size=101, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)

MODELS: dict[str, Callable[[], Toy]] = {
    "qwen3": lambda: build(
        Qwen3ForCausalLM,
        Qwen3Config(
            **SMALL,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=48,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_tied": lambda: build(
        Qwen3ForCausalLM,
        Qwen3Config(
            **SMALL,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": lambda: build(
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **SMALL,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            mlp_only_layers=[1],
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": lambda: build(
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            **SMALL,
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            tie_word_embeddings=False,
        ),
    ),
}

# At least three parallel layouts per model, covering uneven pipelines, virtual pipelines, EP, expert TP and
# both expert naming schemes.
TRAINER_LAYOUTS: dict[str, list[Parallel]] = {
    "qwen3": [Parallel(), Parallel(tp=2, pp=2, first=1, last=3), Parallel(tp=2, pp=2, vpp=2, divisor=64)],
    "qwen3_tied": [Parallel(), Parallel(tp=2, pp=2), Parallel(tp=2, pp=2, vpp=2)],
    "qwen3_moe": [
        Parallel(),
        Parallel(tp=2, pp=2, ep=2, etp=1, first=1, last=3),
        Parallel(tp=2, pp=2, vpp=2, ep=4, etp=2, grouped_gemm=True),
        Parallel(tp=1, pp=4, ep=8, etp=1),
    ],
    "deepseek_v3": [
        Parallel(),
        Parallel(tp=2, pp=3, ep=2),
        Parallel(tp=2, pp=3, ep=2, mla_down_split=True),
        Parallel(tp=4, pp=1, ep=4, etp=2, grouped_gemm=True),
    ],
}

INFERENCE_LAYOUTS: dict[str, list[SGLangLayout]] = {
    "qwen3": [SGLangLayout(), SGLangLayout(tp=2), SGLangLayout(tp=4), SGLangLayout(tp=4, dp_attention=2)],
    "qwen3_tied": [SGLangLayout(tp=2), SGLangLayout(tp=4, dp_attention=4)],
    "qwen3_moe": [
        SGLangLayout(tp=2, ep=2),
        SGLangLayout(tp=4),
        SGLangLayout(tp=4, ep=4, dp_attention=2, dp_lm_head=True),
    ],
    "deepseek_v3": [SGLangLayout(tp=2), SGLangLayout(tp=4, ep=2), SGLangLayout(tp=4, ep=4, dp_attention=4)],
}

_TOYS: dict[str, Toy] = {}


def toy(name: str) -> Toy:
    if name not in _TOYS:
        _TOYS[name] = MODELS[name]()
    return _TOYS[name]


def trainer_pieces(t: Toy, par: Parallel) -> list:
    layout = par.layout(t.spec.num_layers)
    pieces = []
    for rank in par.ranks():
        plan = trainer_plan(t.spec, layout, rank)
        pieces += plan.convert(megatron_chunks(t.spec, t.canonical, par, rank))
    return pieces


def trainer_cases() -> list:
    return [
        pytest.param(m, par, id=f"{m}-{i}")
        for m, layouts in TRAINER_LAYOUTS.items()
        for i, par in enumerate(layouts)
    ]


def inference_cases() -> list:
    return [
        pytest.param(m, lay, id=f"{m}-tp{lay.tp}-ep{lay.ep}-dp{lay.dp_attention}")
        for m, layouts in INFERENCE_LAYOUTS.items()
        for lay in layouts
    ]


@pytest.mark.parametrize(("model", "par"), trainer_cases())
def test_trainer_shards_convert_back_to_the_model(model: str, par: Parallel) -> None:
    t = toy(model)
    back = assemble(trainer_pieces(t, par), t.catalogue)
    for name, tensor in t.canonical.items():
        assert torch.equal(back[name], tensor), name
    assert torch.equal(logits_with(t, back), t.logits)


@pytest.mark.parametrize(("model", "layout"), inference_cases())
def test_sglang_ranks_receive_their_layout_and_read_back(model: str, layout: SGLangLayout) -> None:
    t = toy(model)
    pieces = trainer_pieces(t, TRAINER_LAYOUTS[model][1])
    read_back = []
    for tp_rank in layout.ranks():
        plan = inference_plan(t.spec, layout, tp_rank)
        params = deliver(plan, pieces)
        expected = sglang_params(t.spec, t.canonical, layout, tp_rank)
        assert set(params) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), f"rank {tp_rank}: {name}"
        plan.check(params)
        read_back += plan.read(params)
    back = assemble(read_back, t.catalogue)
    assert torch.equal(logits_with(t, back), t.logits)


@pytest.mark.parametrize(
    "layout", [SGLangLayout(tp=2), SGLangLayout(tp=4, ep=2)], ids=lambda lay: f"tp{lay.tp}"
)
def test_sglang_ranks_receive_tp_split_mla_down_projections(layout: SGLangLayout) -> None:
    """Down projections split over the trainer's TP arrive whole in SGLang's replicated fused q_a/kv_a."""
    t = toy("deepseek_v3")
    par = next(p for p in TRAINER_LAYOUTS["deepseek_v3"] if p.mla_down_split and p.tp > 1)
    pieces = trainer_pieces(t, par)
    assert any(s.name.endswith("q_a_proj.weight") and s.box.lengths[0] < s.global_shape[0] for s, _ in pieces)
    for tp_rank in layout.ranks():
        plan = inference_plan(t.spec, layout, tp_rank)
        params = deliver(plan, pieces)
        expected = sglang_params(t.spec, t.canonical, layout, tp_rank)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), f"rank {tp_rank}: {name}"


def test_logits_notice_a_misplaced_kv_head() -> None:
    """The end-to-end check can fail: swapping two KV heads of one layer (a GQA split error) moves logits."""
    t = toy("qwen3")
    wrong = dict(t.canonical)
    k = wrong["model.layers.2.self_attn.k_proj.weight"]
    d = t.spec.head_dim
    wrong["model.layers.2.self_attn.k_proj.weight"] = torch.cat([k[d:], k[:d]])
    assert not torch.equal(logits_with(t, wrong), t.logits)


def test_logits_notice_a_misplaced_mla_fused_row_block() -> None:
    """The MLA check can fail: an interleaved q_a/kv_a has the same shape and changes the logits."""
    t = toy("deepseek_v3")
    wrong = dict(t.canonical)
    q_a = wrong["model.layers.0.self_attn.q_a_proj.weight"]
    wrong["model.layers.0.self_attn.q_a_proj.weight"] = torch.cat([q_a[12:], q_a[:12]])
    assert not torch.equal(logits_with(t, wrong), t.logits)
