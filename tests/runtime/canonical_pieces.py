"""Test helpers around canonical pieces: origin-encoded weights, reassembly with coverage checks, and a
stand-in for the transfer (each inference target box intersected with every trainer piece, as the plan
builder does)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

from colocate_runtime.convert import CanonicalTensor, InferenceRankPlan
from colocate_runtime.dtypes import torch_dtype
from colocate_runtime.shards import TensorShard

Pieces = Iterable[tuple[TensorShard, torch.Tensor]]
ORIGIN_STRIDE = 4096  # origin value = tensor id * stride + flat index: exact in fp32 for small test models


def origin_tensors(catalogue: Mapping[str, CanonicalTensor]) -> dict[str, torch.Tensor]:
    """Every element's value says which tensor and which element it is (float64; cast by the converters)."""
    out = {}
    assert len(catalogue) * ORIGIN_STRIDE < 2**24, "too many tensors for exact fp32 origins"
    for i, (name, tensor) in enumerate(sorted(catalogue.items())):
        numel = int(torch.Size(tensor.shape).numel())
        assert numel < ORIGIN_STRIDE, f"{name} is too large for origin encoding"
        out[name] = (i * ORIGIN_STRIDE + torch.arange(numel, dtype=torch.float64)).reshape(tensor.shape) + 1
    return out


def decode_origin(value: float) -> tuple[int, int]:
    """(tensor id in sorted-name order, flat element index) of an origin-encoded value."""
    tensor_id, flat = divmod(int(value) - 1, ORIGIN_STRIDE)
    return tensor_id, flat


def assemble(pieces: Pieces, catalogue: Mapping[str, CanonicalTensor]) -> dict[str, torch.Tensor]:
    """Full canonical tensors from pieces: every element covered, overlaps equal, metadata matching."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for shard, data in pieces:
        tensor = catalogue[shard.name]
        assert (shard.global_shape, shard.dtype) == (tensor.shape, tensor.dtype), shard
        assert tuple(data.shape) == shard.box.lengths, (shard, tuple(data.shape))
        assert data.dtype == torch_dtype(shard.dtype), (shard, data.dtype)
        if shard.name not in full:
            full[shard.name] = torch.zeros(tensor.shape, dtype=data.dtype)
            seen[shard.name] = torch.zeros(tensor.shape, dtype=torch.bool)
        region, mask = full[shard.name][shard.box.slices()], seen[shard.name][shard.box.slices()]
        assert torch.equal(region[mask], data[mask]), f"{shard.name}: replicas disagree in {shard.box}"
        region.copy_(data)
        mask.fill_(True)
    assert set(full) == set(catalogue), sorted(set(catalogue) ^ set(full))[:5]
    for name, mask in seen.items():
        assert bool(mask.all()), f"{name}: {int((~mask).sum())} elements never covered"
    return full


def deliver(plan: InferenceRankPlan, pieces: Pieces) -> dict[str, torch.Tensor]:
    """An inference rank's parameters after receiving, for each of its target boxes, every overlapping part of
    the trainer pieces; asserts each target is fully covered."""
    by_name: dict[str, list[tuple[TensorShard, torch.Tensor]]] = defaultdict(list)
    for shard, data in pieces:
        by_name[shard.name].append((shard, data))
    dtypes = {p.name: next((pl.shard.dtype for pl in p.placements), plan.spec.dtype) for p in plan.params}
    params = {
        name: torch.zeros(shape, dtype=torch_dtype(dtypes[name]))
        for name, shape in plan.param_shapes().items()
    }
    for target in plan.shards():
        covered = torch.zeros(target.box.lengths, dtype=torch.bool)
        for source, data in by_name[target.name]:
            common = target.box.intersect(source.box)
            if common is None:
                continue
            piece = TensorShard(target.name, target.global_shape, target.dtype, common)
            plan.write(params, piece, data[common.relative_to(source.box).slices()])
            covered[common.relative_to(target.box).slices()] = True
        assert bool(covered.all()), f"{target.name}: {target.box} not fully fed by the trainer pieces"
    return params


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of a tensor's storage (a CPU stand-in for reading memory by address)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def sglang_arena(plan: InferenceRankPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SGLang's parameters (fused qkv_proj, gate_up_proj, w13/w2, padded vocabulary) in one arena, so that a
    destination address is an offset in it."""
    shapes = plan.param_shapes()
    arena = torch.zeros(sum(math.prod(s) for s in shapes.values()), dtype=torch_dtype(plan.spec.dtype))
    params, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        params[name] = arena[at : at + n].view(shape)
        at += n
    return arena, params


def deliver_local(
    iplan: InferenceRankPlan, pieces: Pieces
) -> dict[str, tuple[tuple[slice, ...], torch.Tensor]]:
    """Reference: the part of each SGLang target that this trainer rank holds (where in the target, data),
    cut from the converted pieces."""
    out = {}
    by_name = {s.name: (s, d) for s, d in pieces}
    for target in iplan.shards():
        if target.name not in by_name:
            continue
        source, data = by_name[target.name]
        common = target.box.intersect(source.box)
        if common is not None:
            where = common.relative_to(target.box).slices()
            out[target.name] = (where, data[common.relative_to(source.box).slices()])
    return out
