"""A real local-spec rank's state dict, renamed into what the same rank holds under Megatron's
Transformer-Engine layer spec (Transformer-Engine cannot be built here, so no TE model is instantiated).

Which TE module sits where comes from the release itself (`worker.te_spec` runs its spec functions); the
parameter names of those modules are Transformer-Engine's, as Megatron's own code addresses them:
- TELayerNormColumnParallelLinear (te.pytorch.LayerNormLinear): `weight` and the fused norm's
  `layer_norm_weight`, which replaces the separate norm (the TE spec puts IdentityOp there); Megatron's local
  spec states the same correspondence in `sharded_state_dict_keys_map` ("input_layernorm." ->
  "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm." -> "mlp.linear_fc1.layer_norm_");
- TEGroupedMLP (te.pytorch.GroupedLinear): expert i of a rank is `experts.linear_fc1.weight{i}`;
- TELinear for the MLA down projections (duplicated, TE spec from 0.14): every TP rank holds the whole
  tensor, the concatenation of the column-parallel parts in TP-rank order; TEColumnParallelLinear (before
  0.14) keeps the local spec's split.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

LN_LINEAR = "TELayerNormColumnParallelLinear"
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_LAYER = re.compile(r"^(decoder\.layers\.\d+)\.(.*)$")

# A separate norm (local spec) -> the TE linear it is fused into when the TE spec puts IdentityOp there.
_FUSED_NORMS = {
    "input_layernorm.weight": ("input_layernorm", "self_attention.linear_qkv"),
    "pre_mlp_layernorm.weight": ("pre_mlp_layernorm", "mlp.linear_fc1"),
    "self_attention.q_layernorm.weight": (
        "self_attention.q_layernorm",
        "self_attention.linear_q_up_proj",
    ),
    "self_attention.kv_layernorm.weight": (
        "self_attention.kv_layernorm",
        "self_attention.linear_kv_up_proj",
    ),
}


def mla_down_split(te: Mapping[str, str]) -> bool:
    """Whether the TE spec's MLA down projections are TP-split (column-parallel) rather than duplicated."""
    kinds = {te[f"dense.self_attention.linear_{p}_down_proj"] for p in ("q", "kv")}
    if kinds == {"TELinear"}:
        return False
    if kinds == {"TEColumnParallelLinear"}:
        return True
    raise AssertionError(f"MLA down projections of the TE spec: {kinds}")


def to_te_names(
    ranks: Sequence[Mapping[str, torch.Tensor]], tp_ranks: Sequence[int], te: Mapping[str, str]
) -> list[dict[str, torch.Tensor]]:
    """Every rank's local-spec state dict under TE-spec names (`ranks[i]` is at TP rank `tp_ranks[i]`)."""
    moe_layers = {m.group(1) for name in ranks[0] if (m := _LAYER.match(name)) and ".mlp.router." in name}
    split = "dense.self_attention.linear_q_down_proj" not in te or mla_down_split(te)
    whole: dict[str, torch.Tensor] = {}
    if not split:  # TELinear: each rank holds the column-parallel parts of every TP rank, in TP-rank order
        by_tp = {tp: state for tp, state in sorted(zip(tp_ranks, ranks, strict=True), key=lambda p: p[0])}
        for name in (n for n in ranks[0] if n.endswith("_down_proj.weight")):
            whole[name] = torch.cat([state[name] for state in by_tp.values()])
    return [
        {_te_name(name, moe_layers, te): whole.get(name, t) for name, t in state.items()} for state in ranks
    ]


def _te_name(name: str, moe_layers: set[str], te: Mapping[str, str]) -> str:
    layer = _LAYER.match(name)
    if layer is None:
        return name
    at, rest = layer.groups()
    kind = "moe" if at in moe_layers else "dense"
    if (expert := _EXPERT.match(name)) and te["moe.mlp.experts"] == "TEGroupedMLP":
        stem, index, linear = expert.groups()
        return f"{stem}.{linear}.weight{index}"
    if rest in _FUSED_NORMS:
        norm, linear = _FUSED_NORMS[rest]
        if te.get(f"{kind}.{norm}") == "IdentityOp" and te.get(f"{kind}.{linear}") == LN_LINEAR:
            return f"{at}.{linear}.layer_norm_weight"
    return name
