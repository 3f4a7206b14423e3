"""BailingMoE (Ling/Ring V2, and V2.5 with Lightning linear attention).

Bailing names its modules `attention.query_key_value`, `attention.dense`, `query_layernorm`/`key_layernorm`,
and SGLang calls its input embedding `model.word_embeddings`; the canonical names are the shared ones
(`embed_tokens`, q/k/v split) so both sides' name sets meet. In V2.5 a layer is linear (Lightning) unless
`(layer + 1) % layer_group_size == 0`; linear-attention models keep lm_head in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.attention import AttentionNames, grouped_attention
from colocate_runtime.convert.embedding import input_embedding, output_head
from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.hf_config import head_dim, model_dtype, optional_dtype, require
from colocate_runtime.convert.lightning import lightning_attention
from colocate_runtime.convert.mlp import GatedMLP
from colocate_runtime.convert.moe import RoutedExperts, expert_bias, router, shared_experts
from colocate_runtime.convert.norms import layer_norms
from colocate_runtime.convert.spec import ModelDims, MoESpec

SOFTMAX_ATTENTION = AttentionNames(
    module="attention",
    fused_qkv="query_key_value",
    output="dense",
    q_norm="query_layernorm",
    k_norm="key_layernorm",
)


def spec_from_hf(config: Mapping[str, Any]) -> ModelDims:
    if config.get("norm_head"):
        # L2-normalising lm_head over the vocabulary needs every vocab shard at once; not a per-rank rule.
        raise UnsupportedLayoutError("bailing_moe: norm_head=True (normalised lm_head) is not supported")
    layers = int(require(config, "num_hidden_layers"))
    heads = int(require(config, "num_attention_heads"))
    group = int(config.get("layer_group_size") or 0)
    linear = frozenset(i for i in range(layers) if group and (i + 1) % group != 0)
    moe_size = int(require(config, "moe_intermediate_size"))
    shared = int(
        config.get("moe_shared_expert_intermediate_size")
        or moe_size * int(config.get("num_shared_experts") or 0)
    )
    dtype = model_dtype(config)
    moe = MoESpec(
        num_experts=int(require(config, "num_experts", "num_local_experts")),
        intermediate_size=moe_size,
        layers=frozenset(range(int(config.get("first_k_dense_replace", 0)), layers)),
        shared_intermediate_size=shared,
        expert_bias=bool(config.get("moe_router_enable_expert_bias", False)),
        router_dtype=optional_dtype(config.get("router_dtype")),
    )
    return ModelDims(
        architecture="bailing_moe",
        hidden_size=int(require(config, "hidden_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim(config),
        vocab_size=int(require(config, "vocab_size")),
        intermediate_size=int(require(config, "intermediate_size")),
        dtype=dtype,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("use_qkv_bias", False)),
        attention_output_bias=bool(config.get("use_bias", False)),
        qk_norm=bool(config.get("use_qk_norm", False)),
        moe=moe,
        linear_attention_layers=linear,
        lm_head_dtype="float32" if linear else None,
    )


def embedding(spec: ModelDims) -> list[Block]:
    return input_embedding(spec, sglang_name="model.word_embeddings.weight")


def layer(spec: ModelDims, layer: int) -> list[Block]:
    moe = spec.require_moe()
    mlp = f"model.layers.{layer}.mlp"
    attention = (
        lightning_attention(spec, layer)
        if layer in spec.linear_attention_layers
        else grouped_attention(spec, layer, SOFTMAX_ATTENTION)
    )
    blocks: list[Block] = [*layer_norms(spec, layer), *attention]
    if not spec.is_moe(layer):
        return [*blocks, GatedMLP(mlp, "mlp", spec.hidden_size, spec.intermediate_size, spec.dtype)]
    blocks += [router(spec, mlp), RoutedExperts(moe, spec.hidden_size, spec.dtype, mlp)]
    if moe.expert_bias:
        blocks.append(expert_bias(moe, f"{mlp}.gate.expert_bias"))
    blocks += shared_experts(spec, moe, mlp)
    return blocks


ARCHITECTURE = Architecture(
    "bailing_moe",
    ("bailing_moe", "bailing_moe_v2", "bailing_moe_linear"),
    spec_from_hf,
    embedding,
    layer,
    output_head,
)
