"""Mixture-of-experts weights: router, routing bias and routed experts.

Expert ids are global in the canonical form: a rank's local expert i is expert `i + ep_rank * E / ep` on
both sides (Megatron EP and SGLang `--ep-size` both give each rank a contiguous range). Each expert's
intermediate dimension is split over the expert-TP group. SGLang stacks its local experts into
`w13_weight` [E_local, 2 * I_tp, H] (gate half, then up half) and `w2_weight` [E_local, H, I_tp].
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.convert.boxes import split_box
from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.layout import Group, RankGroups
from colocate_runtime.convert.mlp import GatedMLP, first_half, second_half
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, Piece, Placement, SGLangParam
from colocate_runtime.convert.spec import ModelDims, MoESpec
from colocate_runtime.shards import TensorShard


def router(spec: ModelDims, prefix: str) -> Direct:
    """The routing weight travels in the configured router dtype (SGLang may keep it in fp32)."""
    shape = (spec.require_moe().num_experts, spec.hidden_size)
    tensor = CanonicalTensor(f"{prefix}.gate.weight", shape, spec.router_dtype)
    return Direct(tensor, ("mlp.router.weight",), tensor.name)


def expert_bias(moe: MoESpec, name: str) -> Direct:
    """Aux-loss-free routing bias: always fp32; in bf16 it rounds away the small updates that steer routing
    (the seed saw SGLang diverge at step 0). Megatron keeps it as a buffer, so pass buffers too."""
    return Direct(CanonicalTensor(name, (moe.num_experts,), "float32"), ("mlp.router.expert_bias",), name)


def shared_experts(spec: ModelDims, moe: MoESpec, mlp: str) -> list[GatedMLP]:
    """The always-on experts beside the routed ones (DeepSeek-V3, Bailing): a gated MLP, when present."""
    if not moe.shared_intermediate_size:
        return []
    return [
        GatedMLP(
            f"{mlp}.shared_experts",
            "mlp.shared_experts",
            spec.hidden_size,
            moe.shared_intermediate_size,
            spec.dtype,
        )
    ]


def local_experts(name: str, num_experts: int, group: Group) -> range:
    """Global ids of the experts one expert-parallel rank holds, in local order."""
    if num_experts % group.size:
        raise UnsupportedLayoutError(
            f"{name}: {num_experts} experts do not split over expert parallel {group.size}"
        )
    per_rank = num_experts // group.size
    return range(group.rank * per_rank, (group.rank + 1) * per_rank)


@dataclass(frozen=True)
class RoutedExperts:
    moe: MoESpec
    hidden: int
    dtype: str
    prefix: str  # canonical and SGLang module, e.g. "model.layers.3.mlp"

    def _tensors(self, expert: int) -> tuple[CanonicalTensor, CanonicalTensor, CanonicalTensor]:
        p, h, i = f"{self.prefix}.experts.{expert}", self.hidden, self.moe.intermediate_size
        return (
            CanonicalTensor(f"{p}.gate_proj.weight", (i, h), self.dtype),
            CanonicalTensor(f"{p}.up_proj.weight", (i, h), self.dtype),
            CanonicalTensor(f"{p}.down_proj.weight", (h, i), self.dtype),
        )

    def _shards(self, expert: int, group: Group) -> tuple[TensorShard, TensorShard, TensorShard]:
        gate, up, down = self._tensors(expert)
        return (
            gate.shard(split_box(gate.name, gate.shape, 0, group)),
            up.shard(split_box(up.name, up.shape, 0, group)),
            down.shard(split_box(down.name, down.shape, 1, group)),
        )

    def _experts(self, groups: RankGroups) -> range:
        return local_experts(f"{self.prefix}.experts", self.moe.num_experts, groups.expert_parallel)

    def canonical(self) -> list[CanonicalTensor]:
        return [t for e in range(self.moe.num_experts) for t in self._tensors(e)]

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        params = []
        for local, expert in enumerate(self._experts(groups)):
            gate, up, down = self._shards(expert, groups.expert_tensor)
            # SequentialMLP names first, then TEGroupedMLP's per-expert weights.
            stems = (
                f"{at}mlp.experts.local_experts.{local}.linear_fc{{}}.weight",
                f"{at}mlp.experts.linear_fc{{}}.weight{local}",
            )
            rows = gate.box.lengths[0]
            params += [
                MegatronParam(
                    tuple(s.format(1) for s in stems),
                    (2 * rows, self.hidden),
                    (Piece(gate, first_half), Piece(up, second_half)),
                ),
                MegatronParam(tuple(s.format(2) for s in stems), down.box.lengths, (Piece(down),)),
            ]
        return params

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        w13: list[Placement] = []
        w2: list[Placement] = []
        experts = self._experts(groups)
        rows = split_box(self.prefix, (self.moe.intermediate_size,), 0, groups.expert_tensor).lengths[0]
        for local, expert in enumerate(experts):
            gate, up, down = self._shards(expert, groups.expert_tensor)
            w13 += [Placement(gate, (0, 0), (local,)), Placement(up, (rows, 0), (local,))]
            w2.append(Placement(down, (0, 0), (local,)))
        return [
            SGLangParam(
                f"{self.prefix}.experts.w13_weight", (len(experts), 2 * rows, self.hidden), tuple(w13)
            ),
            SGLangParam(f"{self.prefix}.experts.w2_weight", (len(experts), self.hidden, rows), tuple(w2)),
        ]
