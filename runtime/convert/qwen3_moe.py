"""Qwen3-MoE: Qwen3 attention; MoE layers with a router and routed experts (no shared experts)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from colocate_runtime.convert import qwen3
from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.attention import AttentionNames, grouped_attention
from colocate_runtime.convert.embedding import input_embedding, output_head
from colocate_runtime.convert.hf_config import optional_dtype, require
from colocate_runtime.convert.moe import RoutedExperts, router
from colocate_runtime.convert.norms import layer_norms
from colocate_runtime.convert.spec import ModelDims, MoESpec


def spec_from_hf(config: Mapping[str, Any]) -> ModelDims:
    dense = qwen3.spec_from_hf({"intermediate_size": 0, **config})
    layers = int(require(config, "num_hidden_layers"))
    step = int(config.get("decoder_sparse_step", 1))
    dense_only = set(config.get("mlp_only_layers") or ())
    moe = MoESpec(
        num_experts=int(require(config, "num_experts", "num_local_experts")),
        intermediate_size=int(require(config, "moe_intermediate_size")),
        layers=frozenset(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
        router_dtype=optional_dtype(config.get("router_dtype")),
    )
    return replace(dense, architecture="qwen3_moe", moe=moe)


def layer(spec: ModelDims, layer: int) -> list[Block]:
    blocks: list[Block] = [*layer_norms(spec, layer), *grouped_attention(spec, layer, AttentionNames())]
    if not spec.is_moe(layer):
        return [*blocks, qwen3.dense_mlp(spec, layer)]
    moe, mlp = spec.require_moe(), f"model.layers.{layer}.mlp"
    return [
        *blocks,
        router(spec, mlp),
        RoutedExperts(moe, spec.hidden_size, spec.dtype, mlp),
    ]


ARCHITECTURE = Architecture("qwen3_moe", ("qwen3_moe",), spec_from_hf, input_embedding, layer, output_head)
