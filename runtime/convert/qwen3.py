"""Qwen3 (dense): GQA with per-head q/k norms, gated MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.attention import AttentionNames, grouped_attention
from colocate_runtime.convert.embedding import input_embedding, output_head
from colocate_runtime.convert.hf_config import head_dim, model_dtype, require
from colocate_runtime.convert.mlp import GatedMLP
from colocate_runtime.convert.norms import layer_norms
from colocate_runtime.convert.spec import ModelDims


def spec_from_hf(config: Mapping[str, Any]) -> ModelDims:
    heads = int(require(config, "num_attention_heads"))
    bias = bool(config.get("attention_bias", False))
    return ModelDims(
        architecture="qwen3",
        hidden_size=int(require(config, "hidden_size")),
        num_layers=int(require(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim(config),
        vocab_size=int(require(config, "vocab_size")),
        intermediate_size=int(require(config, "intermediate_size")),
        dtype=model_dtype(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        attention_output_bias=bias,
        qk_norm=True,
    )


def dense_mlp(spec: ModelDims, layer: int) -> GatedMLP:
    return GatedMLP(f"model.layers.{layer}.mlp", "mlp", spec.hidden_size, spec.intermediate_size, spec.dtype)


def layer(spec: ModelDims, layer: int) -> list[Block]:
    return [
        *layer_norms(spec, layer),
        *grouped_attention(spec, layer, AttentionNames()),
        dense_mlp(spec, layer),
    ]


ARCHITECTURE = Architecture("qwen3", ("qwen3",), spec_from_hf, input_embedding, layer, output_head)
