"""Architectures by name, and the canonical catalogue of a model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from colocate_runtime.convert import bailing_moe, deepseek_v3, qwen3, qwen3_moe
from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.errors import ConvertError, UnknownArchitectureError
from colocate_runtime.convert.hf_config import dtype_name
from colocate_runtime.convert.params import CanonicalTensor
from colocate_runtime.convert.spec import ModelDims

_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    if _REGISTRY.get(arch.name, arch) is not arch:
        raise ConvertError(f"architecture {arch.name!r} is already registered")
    _REGISTRY[arch.name] = arch


def architecture(name: str) -> Architecture:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownArchitectureError(name, _REGISTRY) from None


def architectures() -> list[str]:
    return sorted(_REGISTRY)


def architecture_for_hf(config: Mapping[str, Any]) -> Architecture:
    model_type = config.get("model_type")
    for arch in _REGISTRY.values():
        if model_type in arch.hf_model_types:
            return arch
    raise UnknownArchitectureError(f"(Hugging Face model_type) {model_type}", _REGISTRY)


def model_spec(
    config: Mapping[str, Any], *, dtype: str | None = None, router_dtype: str | None = None
) -> ModelDims:
    """A `ModelDims` from a Hugging Face config dict; `dtype` and `router_dtype` override what it says."""
    spec = architecture_for_hf(config).spec_from_hf(config)
    if dtype is not None:
        spec = replace(spec, dtype=dtype_name(dtype))
    if router_dtype is not None:
        spec = replace(spec, moe=replace(spec.require_moe(), router_dtype=dtype_name(router_dtype)))
    return spec


def stage_blocks(
    spec: ModelDims, layers: Iterable[int], first: bool, last: bool
) -> list[tuple[int | None, Block]]:
    """The blocks of a pipeline chunk with the global layer each belongs to (None: not a decoder layer)."""
    arch = architecture(spec.architecture)
    blocks: list[tuple[int | None, Block]] = [(None, b) for b in arch.first_stage(spec)] if first else []
    blocks += [(layer, b) for layer in layers for b in arch.layer(spec, layer)]
    if last:
        blocks += [(None, b) for b in arch.last_stage(spec)]
    return blocks


def canonical_tensors(spec: ModelDims) -> dict[str, CanonicalTensor]:
    """Every canonical tensor of the model, by name."""
    catalogue: dict[str, CanonicalTensor] = {}
    for _, block in stage_blocks(spec, range(spec.num_layers), first=True, last=True):
        for tensor in block.canonical():
            if tensor.name in catalogue:
                raise ConvertError(f"{spec.architecture}: two rules produce {tensor.name}")
            catalogue[tensor.name] = tensor
    return catalogue


for _arch in (qwen3.ARCHITECTURE, qwen3_moe.ARCHITECTURE, deepseek_v3.ARCHITECTURE, bailing_moe.ARCHITECTURE):
    register(_arch)
