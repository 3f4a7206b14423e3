"""A small deterministic 'model' for the colocated tests: mixed dtypes, one non-contiguous target."""

from __future__ import annotations

import torch

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((64, 32), torch.bfloat16),
    "model.layers.0.self_attn.qkv_proj.weight": ((96, 32), torch.bfloat16),
    "model.layers.0.mlp.gate.weight": ((8, 32), torch.float32),  # router stays fp32
    "model.layers.0.mlp.down_proj.weight": ((32, 48), torch.bfloat16),
    "model.norm.weight": ((32,), torch.float32),
    "lm_head.weight": ((64, 32), torch.bfloat16),
}


def weights(step: int, device: str | torch.device = "cpu", scale: int = 1) -> dict[str, torch.Tensor]:
    """The trainer's canonical tensors after `step` (equal bits for equal step, on any device)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        full = (shape[0] * scale, *shape[1:])
        out[name] = torch.randn(full, generator=gen, dtype=torch.float32).to(dtype).to(device)
    return out


def targets(device: str | torch.device = "cpu", scale: int = 1) -> dict[str, torch.Tensor]:
    """The inference side's parameters; `down_proj` is a transposed (non-contiguous) view, as a fused
    parameter's slice would be."""
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        full = (shape[0] * scale, *shape[1:])
        if name.endswith("down_proj.weight"):
            out[name] = torch.zeros(tuple(reversed(full)), dtype=dtype, device=device).t()
        else:
            out[name] = torch.zeros(full, dtype=dtype, device=device)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ia = a.contiguous().reshape(-1).view(torch.uint8)
    ib = b.contiguous().reshape(-1).view(torch.uint8).to(ia.device)
    return bool(torch.equal(ia, ib))


def all_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (empty when everything matches)."""
    return [n for n in expected if not bitwise_equal(expected[n], got[n])]
