"""Test helper: put canonical (Hugging Face style) weights into Megatron-core's per-rank layout.

Written from Megatron-core's definitions, independently of colocate_runtime.convert (loops and torch.cat, not
the converters' views), so the converters are checked against a second statement of each rule:
- linear_qkv rows are query groups [q heads of the group; k head; v head], whole groups per TP rank;
- linear_fc1 is [gate shard; up shard] per TP rank, linear_fc2 / linear_proj split on columns;
- the vocabulary is padded to a multiple of divisor * TP (padding rows here are NaN, so a leak shows);
- experts: EP rank r holds experts [r * E / ep, (r + 1) * E / ep), each split over expert TP;
- pipeline: mcore's `get_transformer_layer_offset` formula for uneven first/last stages and virtual stages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from colocate_runtime.convert import MegatronLayout, MegatronRank, ModelDims, PipelineLayout

PADDING = float("nan")


@dataclass(frozen=True)
class Parallel:
    """Megatron's own knobs, as a training script sets them."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    first: int | None = None  # decoder_first_pipeline_num_layers
    last: int | None = None  # decoder_last_pipeline_num_layers
    divisor: int = 8  # make_vocab_size_divisible_by
    grouped_gemm: bool = False  # TEGroupedMLP names: experts.linear_fc1.weight{i}
    mla_down_split: bool = False  # MLA q/kv down projections column-parallel (local spec, TE spec < 0.14)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def layout(self, num_layers: int) -> MegatronLayout:
        if self.first is None and self.last is None:
            pipeline = PipelineLayout.even(num_layers, self.pp, self.vpp)
        else:
            pipeline = PipelineLayout.uneven(num_layers, self.pp, self.first, self.last, self.vpp)
        return MegatronLayout(
            tp=self.tp,
            ep=self.ep,
            etp=self.etp,
            pipeline=pipeline,
            vocab_divisor=self.divisor,
            mla_down_split=self.mla_down_split,
        )

    def ranks(self) -> Iterator[MegatronRank]:
        for pp, tp, ep, etp in itertools.product(
            range(self.pp), range(self.tp), range(self.ep), range(self.expert_tp)
        ):
            yield MegatronRank(tp_rank=tp, pp_rank=pp, ep_rank=ep, etp_rank=etp)


def layer_offset(par: Parallel, num_layers: int, pp_rank: int, vp_stage: int) -> tuple[int, int]:
    """(first global layer, layer count) of a model chunk, following mcore's offset formula."""
    if par.first is None and par.last is None:
        per_chunk = num_layers // (par.pp * par.vpp)
        return (vp_stage * par.pp + pp_rank) * per_chunk, per_chunk
    first_v = 0 if par.first is None else par.first // par.vpp
    last_v = 0 if par.last is None else par.last // par.vpp
    middle_stages = par.pp - (par.first is not None) - (par.last is not None)
    middle = num_layers - (par.first or 0) - (par.last or 0)
    middle_v = middle // par.vpp // middle_stages if middle_stages else 0
    per_vp_stage = first_v + last_v + middle_v * middle_stages
    if pp_rank == 0:
        offset = vp_stage * per_vp_stage
        count = first_v if par.first is not None else middle_v
    else:
        offset = (
            vp_stage * per_vp_stage
            + (first_v if par.first is not None else middle_v)
            + (pp_rank - 1) * middle_v
        )
        count = last_v if (pp_rank == par.pp - 1 and par.last is not None) else middle_v
    return offset, count


def _rows(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    assert t.shape[0] % parts == 0, (t.shape, parts)
    n = t.shape[0] // parts
    return t[index * n : (index + 1) * n]


def _cols(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    assert t.shape[1] % parts == 0, (t.shape, parts)
    n = t.shape[1] // parts
    return t[:, index * n : (index + 1) * n]


def _vocab_shard(t: torch.Tensor, par: Parallel, tp_rank: int) -> torch.Tensor:
    multiple = par.divisor * par.tp
    padded_rows = -(-t.shape[0] // multiple) * multiple
    padded = torch.full((padded_rows, *t.shape[1:]), PADDING, dtype=t.dtype)
    padded[: t.shape[0]] = t
    return _rows(padded, par.tp, tp_rank)


def _grouped_qkv(
    spec: ModelDims, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, par: Parallel, tp_rank: int
):
    d, qpg = spec.head_dim, spec.num_heads // spec.num_kv_heads
    groups = [
        torch.cat([q[g * qpg * d : (g + 1) * qpg * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
        for g in range(spec.num_kv_heads)
    ]
    per_rank = spec.num_kv_heads // par.tp
    return torch.cat(groups[tp_rank * per_rank : (tp_rank + 1) * per_rank])


def _layer(
    spec: ModelDims, t: Mapping[str, torch.Tensor], par: Parallel, rank: MegatronRank
) -> dict[str, torch.Tensor]:
    tp, r = par.tp, rank.tp_rank
    out: dict[str, torch.Tensor] = {}
    attn = "self_attn" if "self_attn.o_proj.weight" in t else "attention"
    is_mla = f"{attn}.kv_b_proj.weight" in t
    is_moe = "mlp.gate.weight" in t
    out["input_layernorm.weight" if is_mla else "self_attention.linear_qkv.layer_norm_weight"] = t[
        "input_layernorm.weight"
    ]
    out["pre_mlp_layernorm.weight" if is_moe else "mlp.linear_fc1.layer_norm_weight"] = t[
        "post_attention_layernorm.weight"
    ]
    if is_mla:
        sa = "self_attention."
        # Duplicated on TP ranks (TELinear), or column-parallel: TP rank r holds rows block r.
        down = (lambda w: _rows(w, tp, r)) if par.mla_down_split else (lambda w: w)
        out[sa + "linear_kv_down_proj.weight"] = down(t[f"{attn}.kv_a_proj_with_mqa.weight"])
        out[sa + "linear_kv_up_proj.layer_norm_weight"] = t[f"{attn}.kv_a_layernorm.weight"]
        out[sa + "linear_kv_up_proj.weight"] = _rows(t[f"{attn}.kv_b_proj.weight"], tp, r)
        out[sa + "linear_proj.weight"] = _cols(t[f"{attn}.o_proj.weight"], tp, r)
        if f"{attn}.q_a_proj.weight" in t:
            out[sa + "linear_q_down_proj.weight"] = down(t[f"{attn}.q_a_proj.weight"])
            out[sa + "linear_q_up_proj.layer_norm_weight"] = t[f"{attn}.q_a_layernorm.weight"]
            out[sa + "linear_q_up_proj.weight"] = _rows(t[f"{attn}.q_b_proj.weight"], tp, r)
        else:
            out[sa + "linear_q_proj.weight"] = _rows(t[f"{attn}.q_proj.weight"], tp, r)
    else:
        for suffix in ("weight", "bias"):
            if f"{attn}.q_proj.{suffix}" in t:
                q, k, v = (t[f"{attn}.{p}_proj.{suffix}"] for p in "qkv")
                out[f"self_attention.linear_qkv.{suffix}"] = _grouped_qkv(spec, q, k, v, par, r)
        output = "o_proj" if attn == "self_attn" else "dense"
        out["self_attention.linear_proj.weight"] = _cols(t[f"{attn}.{output}.weight"], tp, r)
        if f"{attn}.{output}.bias" in t:
            out["self_attention.linear_proj.bias"] = t[f"{attn}.{output}.bias"]
        for mcore, names in (
            ("q_layernorm", ("q_norm", "query_layernorm")),
            ("k_layernorm", ("k_norm", "key_layernorm")),
        ):
            for name in names:
                if f"{attn}.{name}.weight" in t:
                    out[f"self_attention.{mcore}.weight"] = t[f"{attn}.{name}.weight"]
        if f"{attn}.g_proj.weight" in t:  # Lightning attention
            out["self_attention.linear_gate.weight"] = _rows(t[f"{attn}.g_proj.weight"], tp, r)
            out["self_attention.gate_norm.weight"] = _rows(t[f"{attn}.g_norm.weight"], tp, r)
    if is_moe:
        out["mlp.router.weight"] = t["mlp.gate.weight"]
        for bias in ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias"):
            if bias in t:
                out["mlp.router.expert_bias"] = t[bias]
        num_experts = t["mlp.gate.weight"].shape[0]
        per_rank, etp, er = num_experts // par.ep, par.expert_tp, rank.etp_rank
        for i in range(per_rank):
            e = rank.ep_rank * per_rank + i
            fc1 = torch.cat(
                [
                    _rows(t[f"mlp.experts.{e}.gate_proj.weight"], etp, er),
                    _rows(t[f"mlp.experts.{e}.up_proj.weight"], etp, er),
                ]
            )
            fc2 = _cols(t[f"mlp.experts.{e}.down_proj.weight"], etp, er)
            if par.grouped_gemm:
                out[f"mlp.experts.linear_fc1.weight{i}"], out[f"mlp.experts.linear_fc2.weight{i}"] = fc1, fc2
            else:
                out[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1
                out[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = fc2
        mlps = ["mlp.shared_experts"] if "mlp.shared_experts.gate_proj.weight" in t else []
    else:
        mlps = ["mlp"]
    for mlp in mlps:
        out[f"{mlp}.linear_fc1.weight"] = torch.cat(
            [_rows(t[f"{mlp}.gate_proj.weight"], tp, r), _rows(t[f"{mlp}.up_proj.weight"], tp, r)]
        )
        out[f"{mlp}.linear_fc2.weight"] = _cols(t[f"{mlp}.down_proj.weight"], tp, r)
    return out


def megatron_chunks(
    spec: ModelDims, canonical: Mapping[str, torch.Tensor], par: Parallel, rank: MegatronRank
) -> list[dict[str, torch.Tensor]]:
    """The state dicts of one trainer rank's model chunks (one per virtual stage), Megatron-core names."""
    chunks = []
    for vp in range(par.vpp):
        offset, count = layer_offset(par, spec.num_layers, rank.pp_rank, vp)
        state: dict[str, torch.Tensor] = {}
        if rank.pp_rank == 0 and vp == 0:
            state["embedding.word_embeddings.weight"] = _vocab_shard(
                canonical["model.embed_tokens.weight"], par, rank.tp_rank
            )
        for local in range(count):
            prefix = f"model.layers.{offset + local}."
            layer = {k[len(prefix) :]: v for k, v in canonical.items() if k.startswith(prefix)}
            for name, tensor in _layer(spec, layer, par, rank).items():
                state[f"decoder.layers.{local}.{name}"] = tensor.clone()
        if rank.pp_rank == par.pp - 1 and vp == par.vpp - 1:
            state["decoder.final_layernorm.weight"] = canonical["model.norm.weight"]
            if "lm_head.weight" in canonical:
                state["output_layer.weight"] = _vocab_shard(canonical["lm_head.weight"], par, rank.tp_rank)
            elif par.pp > 1:  # tied: the last stage keeps a synchronised copy of the embedding
                state["output_layer.weight"] = _vocab_shard(
                    canonical["model.embed_tokens.weight"], par, rank.tp_rank
                )
        chunks.append(state)
    return chunks
