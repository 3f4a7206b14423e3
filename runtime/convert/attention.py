"""Grouped-query (and multi-head) attention: Megatron's grouped `linear_qkv` to canonical q/k/v, and SGLang's
per-rank fused [q; k; v] projection (`qkv_proj`, or Bailing's `query_key_value`).

A fused tensor's TP shard is not one box of any canonical tensor, so the canonical form keeps q, k and v
apart and each side states where its rows come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from colocate_runtime.convert.architecture import Block
from colocate_runtime.convert.boxes import heads_box
from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.layout import RankGroups, Role
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, Piece, SGLangParam, stacked_rows
from colocate_runtime.convert.qkv import QKV_PARTS, query_group_part, query_group_view
from colocate_runtime.convert.spec import ModelDims


@dataclass(frozen=True)
class GroupedQKV:
    spec: ModelDims
    prefix: str  # canonical module, e.g. "model.layers.3.self_attn"
    fused: str  # SGLang parameter stem, e.g. "model.layers.3.self_attn.qkv_proj"
    megatron_stem: str = "self_attention.linear_qkv"
    bias: bool = False

    def _suffixes(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias else ("weight",)

    def _trailing(self, suffix: str) -> tuple[int, ...]:
        return (self.spec.hidden_size,) if suffix == "weight" else ()

    def _tensor(self, part: str, suffix: str) -> CanonicalTensor:
        heads = self.spec.num_heads if part == "q" else self.spec.num_kv_heads
        shape = (heads * self.spec.head_dim, *self._trailing(suffix))
        return CanonicalTensor(f"{self.prefix}.{part}_proj.{suffix}", shape, self.spec.dtype)

    def _heads(self, part: str) -> int:
        return self.spec.num_heads if part == "q" else self.spec.num_kv_heads

    def canonical(self) -> list[CanonicalTensor]:
        return [self._tensor(part, suffix) for suffix in self._suffixes() for part in QKV_PARTS]

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        group, spec = groups.attention, self.spec
        if spec.num_kv_heads % group.size:
            raise UnsupportedLayoutError(
                f"{self.prefix}: Megatron splits whole query groups; {spec.num_kv_heads} KV heads do not "
                f"split over attention TP {group.size}"
            )
        local_groups = spec.num_kv_heads // group.size
        rows = local_groups * (spec.queries_per_group + 2) * spec.head_dim
        params = []
        for suffix in self._suffixes():
            pieces = []
            for part in QKV_PARTS:
                tensor = self._tensor(part, suffix)
                box = heads_box(
                    tensor.name, self._heads(part), spec.head_dim, self._trailing(suffix), group, False
                )
                where = dict(
                    groups=local_groups,
                    queries_per_group=spec.queries_per_group,
                    head_dim=spec.head_dim,
                    part=part,
                )
                view = partial(query_group_view, **where) if local_groups > 1 else None
                pieces.append(Piece(tensor.shard(box), partial(query_group_part, **where), view))
            name = f"{at}{self.megatron_stem}.{suffix}"
            params.append(MegatronParam((name,), (rows, *self._trailing(suffix)), tuple(pieces)))
        return params

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        params = []
        for suffix in self._suffixes():
            shards = []
            for part in QKV_PARTS:
                tensor = self._tensor(part, suffix)
                replicate = part != "q" and groups.kv_replication
                box = heads_box(
                    tensor.name,
                    self._heads(part),
                    self.spec.head_dim,
                    self._trailing(suffix),
                    groups.attention,
                    replicate,
                )
                shards.append(tensor.shard(box))
            params.append(stacked_rows(f"{self.fused}.{suffix}", shards, self._trailing(suffix)))
        return params


@dataclass(frozen=True)
class AttentionNames:
    """Module names of one architecture's softmax attention, canonical (= SGLang) side."""

    module: str = "self_attn"
    fused_qkv: str = "qkv_proj"
    output: str = "o_proj"
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"


def grouped_attention(spec: ModelDims, layer: int, names: AttentionNames) -> list[Block]:
    """GQA/MHA attention of one layer: fused QKV, output projection, optional bias and per-head q/k norms."""
    prefix = f"model.layers.{layer}.{names.module}"
    d, hidden = spec.head_dim, spec.hidden_size
    blocks: list[Block] = [
        GroupedQKV(spec, prefix, f"{prefix}.{names.fused_qkv}", bias=spec.attention_bias),
        Direct(
            CanonicalTensor(f"{prefix}.{names.output}.weight", (hidden, spec.num_heads * d), spec.dtype),
            ("self_attention.linear_proj.weight",),
            f"{prefix}.{names.output}.weight",
            Role.ATTENTION,
            dim=1,
            unit=d,
        ),
    ]
    if spec.attention_output_bias:
        # Row-parallel bias: added once after the reduction, so every rank holds all of it on both sides.
        bias = CanonicalTensor(f"{prefix}.{names.output}.bias", (hidden,), spec.dtype)
        blocks.append(Direct(bias, ("self_attention.linear_proj.bias",), bias.name))
    if spec.qk_norm:
        for stem, name in (("q_layernorm", names.q_norm), ("k_layernorm", names.k_norm)):
            norm = CanonicalTensor(f"{prefix}.{name}.weight", (d,), spec.dtype)
            blocks.append(Direct(norm, (f"self_attention.{stem}.weight",), norm.name))
    return blocks
