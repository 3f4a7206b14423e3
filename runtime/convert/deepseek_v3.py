"""DeepSeek-V3 style models: multi-head latent attention, dense first layers, MoE with a shared expert and an
fp32 routing bias (`e_score_correction_bias`). Multi-token-prediction layers are not converted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.embedding import input_embedding, output_head
from colocate_runtime.convert.hf_config import model_dtype, optional_dtype, require
from colocate_runtime.convert.mla import MultiLatentAttention
from colocate_runtime.convert.mlp import GatedMLP
from colocate_runtime.convert.moe import RoutedExperts, expert_bias, router, shared_experts
from colocate_runtime.convert.norms import layer_norms
from colocate_runtime.convert.spec import MLASpec, ModelDims, MoESpec


def spec_from_hf(config: Mapping[str, Any]) -> ModelDims:
    layers = int(require(config, "num_hidden_layers"))
    heads = int(require(config, "num_attention_heads"))
    first_dense = int(config.get("first_k_dense_replace", 0))
    every = int(config.get("moe_layer_freq", 1))
    moe_size = int(require(config, "moe_intermediate_size"))
    dtype = model_dtype(config)
    mla = MLASpec(
        kv_lora_rank=int(require(config, "kv_lora_rank")),
        qk_nope_head_dim=int(require(config, "qk_nope_head_dim")),
        qk_rope_head_dim=int(require(config, "qk_rope_head_dim")),
        v_head_dim=int(require(config, "v_head_dim")),
        q_lora_rank=config.get("q_lora_rank"),
    )
    moe = MoESpec(
        num_experts=int(require(config, "n_routed_experts", "num_local_experts")),
        intermediate_size=moe_size,
        layers=frozenset(i for i in range(layers) if i >= first_dense and i % every == 0),
        shared_intermediate_size=moe_size * int(config.get("n_shared_experts") or 0),
        expert_bias=True,
        router_dtype=optional_dtype(config.get("router_dtype")),
    )
    return ModelDims(
        architecture="deepseek_v3",
        hidden_size=int(require(config, "hidden_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,  # MLA has no KV head grouping
        head_dim=mla.q_head_dim,
        vocab_size=int(require(config, "vocab_size")),
        intermediate_size=int(require(config, "intermediate_size")),
        dtype=dtype,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=moe,
        mla=mla,
    )


def layer(spec: ModelDims, layer: int) -> list[Block]:
    moe = spec.require_moe()
    prefix = f"model.layers.{layer}"
    mlp = f"{prefix}.mlp"
    blocks: list[Block] = [
        *layer_norms(spec, layer),
        MultiLatentAttention(
            spec.require_mla(), spec.num_heads, spec.hidden_size, spec.dtype, f"{prefix}.self_attn"
        ),
    ]
    if not spec.is_moe(layer):
        return [*blocks, GatedMLP(mlp, "mlp", spec.hidden_size, spec.intermediate_size, spec.dtype)]
    blocks += [
        router(spec, mlp),
        expert_bias(moe, f"{mlp}.gate.e_score_correction_bias"),
        RoutedExperts(moe, spec.hidden_size, spec.dtype, mlp),
    ]
    blocks += shared_experts(spec, moe, mlp)
    return blocks


ARCHITECTURE = Architecture(
    "deepseek_v3", ("deepseek_v3", "deepseek_v2"), spec_from_hf, input_embedding, layer, output_head
)
