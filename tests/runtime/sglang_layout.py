"""Test helper: the parameters an SGLang TP rank holds, built from canonical weights by SGLang's definitions,
independently of colocate_runtime.convert:
- QKVParallelLinear: [q heads of the rank; its k heads; its v heads], KV heads replicated when attention TP
  exceeds their count (rank r holds KV head r // (tp / kv));
- MergedColumnParallelLinear gate_up_proj: [gate shard; up shard]; RowParallelLinear splits columns;
- FusedMoE w13 [E_local, 2 * I_tp, H] = per expert [gate shard; up shard], w2 [E_local, H, I_tp];
  moe_tp = tp / ep, ep rank = tp_rank // moe_tp;
- DeepSeek fused_qkv_a_proj_with_mqa: ReplicatedLinear holding [q_a; kv_a];
- VocabParallelEmbedding: vocab padded to 64, then split (replicated under DP attention); padding rows zero.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from colocate_runtime.convert import ModelDims, SGLangLayout


def _part(t: torch.Tensor, parts: int, index: int, dim: int = 0) -> torch.Tensor:
    assert t.shape[dim] % parts == 0, (t.shape, parts, dim)
    return t.chunk(parts, dim=dim)[index]


def _heads(t: torch.Tensor, heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    if tp <= heads:
        return _part(t, tp, rank)
    head = rank // (tp // heads)
    return t[head * head_dim : (head + 1) * head_dim]


def _vocab(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    padded = torch.zeros((-(-t.shape[0] // 64) * 64, *t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return _part(padded, tp, rank)


def sglang_params(
    spec: ModelDims,
    canonical: Mapping[str, torch.Tensor],
    layout: SGLangLayout,
    tp_rank: int,
    embedding_name: str = "model.embed_tokens.weight",
) -> dict[str, torch.Tensor]:
    tp = layout.tp
    attn_tp = tp // layout.dp_attention
    attn_rank = tp_rank % attn_tp
    moe_tp = tp // layout.ep
    ep_rank, moe_rank = tp_rank // moe_tp, tp_rank % moe_tp
    dense_tp = layout.moe_dense_tp or tp
    dense_rank = tp_rank % dense_tp
    out: dict[str, torch.Tensor] = {}
    emb = canonical["model.embed_tokens.weight"]
    out[embedding_name] = _vocab(emb, 1, 0) if layout.dp_attention > 1 else _vocab(emb, tp, tp_rank)
    if "lm_head.weight" in canonical:
        head_tp, head_rank = (attn_tp, attn_rank) if layout.dp_lm_head else (tp, tp_rank)
        out["lm_head.weight"] = _vocab(canonical["lm_head.weight"], head_tp, head_rank)
    out["model.norm.weight"] = canonical["model.norm.weight"]
    d = spec.head_dim
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        t = {k[len(p) :]: v for k, v in canonical.items() if k.startswith(p)}
        out[p + "input_layernorm.weight"] = t["input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = t["post_attention_layernorm.weight"]
        attn = "self_attn" if "self_attn.o_proj.weight" in t else "attention"
        a = f"{p}{attn}."
        if f"{attn}.kv_b_proj.weight" in t:
            if f"{attn}.q_a_proj.weight" in t:
                out[a + "fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
                    [t[f"{attn}.q_a_proj.weight"], t[f"{attn}.kv_a_proj_with_mqa.weight"]]
                )
                out[a + "q_a_layernorm.weight"] = t[f"{attn}.q_a_layernorm.weight"]
                out[a + "q_b_proj.weight"] = _part(t[f"{attn}.q_b_proj.weight"], attn_tp, attn_rank)
            else:  # DeepSeek-V2-Lite style: queries projected directly, kv_a replicated on its own
                out[a + "kv_a_proj_with_mqa.weight"] = t[f"{attn}.kv_a_proj_with_mqa.weight"]
                out[a + "q_proj.weight"] = _part(t[f"{attn}.q_proj.weight"], attn_tp, attn_rank)
            out[a + "kv_a_layernorm.weight"] = t[f"{attn}.kv_a_layernorm.weight"]
            out[a + "kv_b_proj.weight"] = _part(t[f"{attn}.kv_b_proj.weight"], attn_tp, attn_rank)
            out[a + "o_proj.weight"] = _part(t[f"{attn}.o_proj.weight"], attn_tp, attn_rank, dim=1)
        else:
            fused = "qkv_proj" if attn == "self_attn" else "query_key_value"
            for suffix in ("weight", "bias"):
                if f"{attn}.q_proj.{suffix}" in t:
                    out[f"{a}{fused}.{suffix}"] = torch.cat(
                        [
                            _part(t[f"{attn}.q_proj.{suffix}"], attn_tp, attn_rank),
                            _heads(t[f"{attn}.k_proj.{suffix}"], spec.num_kv_heads, d, attn_tp, attn_rank),
                            _heads(t[f"{attn}.v_proj.{suffix}"], spec.num_kv_heads, d, attn_tp, attn_rank),
                        ]
                    )
            for name in ("o_proj", "dense"):
                if f"{attn}.{name}.weight" in t:
                    out[f"{a}{name}.weight"] = _part(t[f"{attn}.{name}.weight"], attn_tp, attn_rank, dim=1)
                if f"{attn}.{name}.bias" in t:
                    out[f"{a}{name}.bias"] = t[f"{attn}.{name}.bias"]
            for name in ("q_norm", "k_norm", "query_layernorm", "key_layernorm"):
                if f"{attn}.{name}.weight" in t:
                    out[f"{a}{name}.weight"] = t[f"{attn}.{name}.weight"]
            for name in ("g_proj", "g_norm"):
                if f"{attn}.{name}.weight" in t:
                    out[f"{a}{name}.weight"] = _part(t[f"{attn}.{name}.weight"], attn_tp, attn_rank)
        mlps = []
        if "mlp.gate.weight" in t:
            out[p + "mlp.gate.weight"] = t["mlp.gate.weight"]
            for bias in ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias"):
                if bias in t:
                    out[p + bias] = t[bias]
            per_rank = t["mlp.gate.weight"].shape[0] // layout.ep
            experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
            out[p + "mlp.experts.w13_weight"] = torch.stack(
                [
                    torch.cat(
                        [
                            _part(t[f"mlp.experts.{e}.gate_proj.weight"], moe_tp, moe_rank),
                            _part(t[f"mlp.experts.{e}.up_proj.weight"], moe_tp, moe_rank),
                        ]
                    )
                    for e in experts
                ]
            )
            out[p + "mlp.experts.w2_weight"] = torch.stack(
                [_part(t[f"mlp.experts.{e}.down_proj.weight"], moe_tp, moe_rank, dim=1) for e in experts]
            )
            if "mlp.shared_experts.gate_proj.weight" in t:
                mlps.append("mlp.shared_experts")
        else:
            mlps.append("mlp")
        for mlp in mlps:
            out[f"{p}{mlp}.gate_up_proj.weight"] = torch.cat(
                [
                    _part(t[f"{mlp}.gate_proj.weight"], dense_tp, dense_rank),
                    _part(t[f"{mlp}.up_proj.weight"], dense_tp, dense_rank),
                ]
            )
            out[f"{p}{mlp}.down_proj.weight"] = _part(
                t[f"{mlp}.down_proj.weight"], dense_tp, dense_rank, dim=1
            )
    return out
