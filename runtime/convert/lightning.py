"""Lightning (linear) attention layers of BailingMoE-V2.5.

Its fused `query_key_value` uses the same grouped Megatron layout and per-rank [q; k; v] SGLang layout as
softmax attention, so it is the GQA rule with Bailing's names. With attention TP > 1 every trainer rank
holds a distinct row range of q/k/v and states exactly that box: the seed declared the tensor unsharded,
so only inference rank 0 was fed and the others kept zeros. The output gate (`g_proj`) and its norm
(`g_norm`, kept 1-D as SGLang holds it) are split by heads like the query rows.
"""

from __future__ import annotations

from colocate_runtime.convert.architecture import Block
from colocate_runtime.convert.attention import GroupedQKV
from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.layout import Role
from colocate_runtime.convert.params import CanonicalTensor
from colocate_runtime.convert.spec import ModelDims


def lightning_attention(spec: ModelDims, layer: int) -> list[Block]:
    prefix = f"model.layers.{layer}.attention"
    d, hidden, width = spec.head_dim, spec.hidden_size, spec.num_heads * spec.head_dim
    gate = CanonicalTensor(f"{prefix}.g_proj.weight", (width, hidden), spec.dtype)
    norm = CanonicalTensor(f"{prefix}.g_norm.weight", (width,), spec.dtype)
    dense = CanonicalTensor(f"{prefix}.dense.weight", (hidden, width), spec.dtype)
    return [
        GroupedQKV(spec, prefix, f"{prefix}.query_key_value", bias=spec.attention_bias),
        Direct(gate, ("self_attention.linear_gate.weight",), gate.name, Role.ATTENTION, unit=d),
        Direct(
            norm,
            ("self_attention.gate_norm.weight", "self_attention.pre_gate_norm.weight"),
            norm.name,
            Role.ATTENTION,
            unit=d,
        ),
        Direct(dense, ("self_attention.linear_proj.weight",), dense.name, Role.ATTENTION, dim=1, unit=d),
    ]
