"""Multi-head latent attention (DeepSeek-V2/V3 style).

Megatron-core builds the down projections (`linear_q_down_proj`, `linear_kv_down_proj`) either column-parallel
(each TP rank holds a contiguous row range: the local spec, and the Transformer-Engine spec before 0.14) or
duplicated on every TP rank (TELinear, the Transformer-Engine spec from 0.14); `MegatronLayout.mla_down_split`
says which, and the other fails the shape check naming the shape the rank holds. SGLang holds them as one
ReplicatedLinear `fused_qkv_a_proj_with_mqa`, the plain concatenation [q_a; kv_a], unsharded on every rank. An
interleaved [q_0; kv_0; q_1; kv_1; ...] has the same shape, so only values tell the two apart: tests pin the
plain concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.layout import RankGroups, Role
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, SGLangParam, stacked_rows
from colocate_runtime.convert.spec import MLASpec

ATTN = "self_attention."


@dataclass(frozen=True)
class MultiLatentAttention:
    mla: MLASpec
    heads: int
    hidden: int
    dtype: str
    prefix: str  # canonical and SGLang module, e.g. "model.layers.3.self_attn"

    def _parts(self) -> list[Direct]:
        mla, p, heads, hidden, dtype = self.mla, self.prefix, self.heads, self.hidden, self.dtype

        def tensor(name: str, *shape: int) -> CanonicalTensor:
            return CanonicalTensor(f"{p}.{name}", shape, dtype)

        fused_a = mla.q_lora_rank is not None  # SGLang fuses q_a and kv_a only when queries are low-rank
        parts = [
            Direct(
                tensor("kv_a_proj_with_mqa.weight", mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
                (ATTN + "linear_kv_down_proj.weight",),
                None if fused_a else f"{p}.kv_a_proj_with_mqa.weight",
                Role.MLA_DOWN,
            ),
            Direct(
                tensor("kv_a_layernorm.weight", mla.kv_lora_rank),
                (ATTN + "linear_kv_up_proj.layer_norm_weight", ATTN + "kv_layernorm.weight"),
                f"{p}.kv_a_layernorm.weight",
            ),
            Direct(
                tensor("kv_b_proj.weight", heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                (ATTN + "linear_kv_up_proj.weight",),
                f"{p}.kv_b_proj.weight",
                Role.ATTENTION,
                unit=mla.qk_nope_head_dim + mla.v_head_dim,
            ),
            Direct(
                tensor("o_proj.weight", hidden, heads * mla.v_head_dim),
                (ATTN + "linear_proj.weight",),
                f"{p}.o_proj.weight",
                Role.ATTENTION,
                dim=1,
                unit=mla.v_head_dim,
            ),
        ]
        if mla.q_lora_rank is None:
            parts.append(
                Direct(
                    tensor("q_proj.weight", heads * mla.q_head_dim, hidden),
                    (ATTN + "linear_q_proj.weight",),
                    f"{p}.q_proj.weight",
                    Role.ATTENTION,
                    unit=mla.q_head_dim,
                )
            )
        else:
            parts += [
                Direct(
                    tensor("q_a_proj.weight", mla.q_lora_rank, hidden),
                    (ATTN + "linear_q_down_proj.weight",),
                    None,
                    Role.MLA_DOWN,
                ),
                Direct(
                    tensor("q_a_layernorm.weight", mla.q_lora_rank),
                    (ATTN + "linear_q_up_proj.layer_norm_weight", ATTN + "q_layernorm.weight"),
                    f"{p}.q_a_layernorm.weight",
                ),
                Direct(
                    tensor("q_b_proj.weight", heads * mla.q_head_dim, mla.q_lora_rank),
                    (ATTN + "linear_q_up_proj.weight",),
                    f"{p}.q_b_proj.weight",
                    Role.ATTENTION,
                    unit=mla.q_head_dim,
                ),
            ]
        return parts

    def canonical(self) -> list[CanonicalTensor]:
        return [t for part in self._parts() for t in part.canonical()]

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        return [param for part in self._parts() for param in part.megatron(groups, at)]

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        params = [param for part in self._parts() for param in part.sglang(groups)]
        if self.mla.q_lora_rank is not None:
            by_name = {part.tensor.name: part.tensor for part in self._parts()}
            q_a, kv_a = (
                by_name[f"{self.prefix}.q_a_proj.weight"],
                by_name[f"{self.prefix}.kv_a_proj_with_mqa.weight"],
            )
            params.append(
                stacked_rows(
                    f"{self.prefix}.fused_qkv_a_proj_with_mqa.weight",
                    [q_a.shard(), kv_a.shard()],
                    (self.hidden,),
                )
            )
        return params
