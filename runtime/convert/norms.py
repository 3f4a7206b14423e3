"""Per-layer RMSNorm weights; Megatron names them differently when fused into the next linear layer (TE)."""

from __future__ import annotations

from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.params import CanonicalTensor
from colocate_runtime.convert.spec import ModelDims


def layer_norms(spec: ModelDims, layer: int) -> list[Direct]:
    prefix = f"model.layers.{layer}"
    pre = CanonicalTensor(f"{prefix}.input_layernorm.weight", (spec.hidden_size,), spec.dtype)
    post = CanonicalTensor(f"{prefix}.post_attention_layernorm.weight", (spec.hidden_size,), spec.dtype)
    return [
        Direct(pre, ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"), pre.name),
        Direct(post, ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), post.name),
    ]
