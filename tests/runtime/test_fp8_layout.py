"""The block-FP8 SGLang layout as a function of the model config (runtime/convert/fp8.py), on CPU: names,
dtypes, shapes and scale shapes at real configs and TP degrees, what stays BF16, the config's parsing, and the
layouts SGLang itself refuses (tests/sglang_real/test_fp8_layout.py: against SGLang's own FP8 classes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colocate_runtime.convert import SGLangLayout, UnsupportedLayoutError, inference_plan, model_spec
from colocate_runtime.convert.fp8 import (
    E4M3,
    FP8_BLOCK_FORMAT,
    Fp8Quantization,
    fp8_layout,
    fp8_quantization,
)

QUANT = {
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
}
A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "torch_dtype": "bfloat16",
    "quantization_config": QUANT,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "intermediate_size": 12288,
    "torch_dtype": "bfloat16",
    "quantization_config": QUANT,
}


def layout(config: dict, tp: int = 1, ep: int = 1, rank: int = 0) -> dict:
    quant = fp8_quantization(config)
    assert quant is not None
    plan = inference_plan(model_spec(config), SGLangLayout(tp=tp, ep=ep), rank)
    return {n: (p.dtype, p.shape) for n, p in fp8_layout(plan, quant).items()}


def test_qwen3_moe_a3b_tp4_ep4() -> None:
    held = layout(A3B, tp=4, ep=4, rank=1)
    a = "model.layers.0.self_attn."
    m = "model.layers.0.mlp."
    # attention at TP 4: 8 q heads, 1 kv head per rank; o_proj's columns split
    assert held[a + "qkv_proj.weight"] == (E4M3, (1280, 2048))
    assert held[a + "qkv_proj.weight_scale_inv"] == ("float32", (10, 16))
    assert held[a + "o_proj.weight"] == (E4M3, (2048, 1024))
    assert held[a + "o_proj.weight_scale_inv"] == ("float32", (16, 8))
    # experts over EP 4: 32 local experts, whole (moe TP 1)
    assert held[m + "experts.w13_weight"] == (E4M3, (32, 1536, 2048))
    assert held[m + "experts.w13_weight_scale_inv"] == ("float32", (32, 12, 16))
    assert held[m + "experts.w2_weight"] == (E4M3, (32, 2048, 768))
    assert held[m + "experts.w2_weight_scale_inv"] == ("float32", (32, 16, 6))
    # BF16: router, norms, vocabularies
    for name in (
        m + "gate.weight",
        a + "q_norm.weight",
        a + "k_norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert held[name][0] == "bfloat16", name
    assert not any(n.endswith("_scale_inv") and "gate.weight" in n for n in held)
    fp8 = [n for n, (dtype, _) in held.items() if dtype == E4M3]
    assert len(fp8) == 2 * 4 and all(f"{n}_scale_inv" in held for n in fp8)


def test_qwen3_dense_ragged_scales() -> None:
    """A hidden size of 4000 (not a multiple of 128, unsplit at TP 1): ragged edge blocks, ceil scales."""
    held = layout({**QWEN3_8B, "hidden_size": 4000})
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert held[a + "qkv_proj.weight"] == (E4M3, (6144, 4000))
    assert held[a + "qkv_proj.weight_scale_inv"] == ("float32", (48, 32))
    assert held[m + "gate_up_proj.weight_scale_inv"] == ("float32", (192, 32))
    assert held[m + "down_proj.weight"] == (E4M3, (4000, 12288))
    assert held[m + "down_proj.weight_scale_inv"] == ("float32", (32, 96))


def test_ignored_layers_stay_bf16() -> None:
    config = {
        **QWEN3_8B,
        "quantization_config": {**QUANT, "ignored_layers": ["model.layers.1.self_attn.o_proj"]},
    }
    held = layout(config)
    assert held["model.layers.1.self_attn.o_proj.weight"][0] == "bfloat16"
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" not in held
    assert held["model.layers.0.self_attn.o_proj.weight"][0] == E4M3


def test_config_parsing() -> None:
    assert fp8_quantization({"hidden_size": 8}) is None
    assert fp8_quantization(QWEN3_8B) == Fp8Quantization()
    assert Fp8Quantization().target_dtype == FP8_BLOCK_FORMAT
    for bad in (
        {**QUANT, "quant_method": "awq"},
        {k: v for k, v in QUANT.items() if k != "weight_block_size"},
        {**QUANT, "fmt": "e5m2"},
        {**QUANT, "activation_scheme": "static"},
    ):
        with pytest.raises(UnsupportedLayoutError):
            fp8_quantization({"quantization_config": bad})


def test_layouts_sglang_refuses() -> None:
    # 64-dim heads, 2 KV heads at TP 2: 64 k rows per rank inside the fused qkv_proj (not a whole block)
    small = {
        **QWEN3_8B,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    }
    with pytest.raises(UnsupportedLayoutError, match=r"qkv_proj.*not whole 128-row blocks"):
        layout({**small, "intermediate_size": 512}, tp=2)
    # intermediate 384 at TP 2: 192 rows of gate_up_proj (and columns of down_proj) per rank
    with pytest.raises(UnsupportedLayoutError, match=r"gate_up_proj.*not whole 128-row blocks"):
        layout({**QWEN3_8B, "intermediate_size": 384}, tp=2)
    with pytest.raises(UnsupportedLayoutError, match="not covered"):
        plan = inference_plan(model_spec(QWEN3_8B), SGLangLayout(), 0)
        fp8_layout(replace(plan, spec=replace(plan.spec, architecture="bailing_moe")), Fp8Quantization())
