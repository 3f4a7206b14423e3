"""The block-FP8 side of bench/sglang_gpu.py's check: a BF16 trainer, an SGLang engine serving block FP8.

SGLang serves a block-FP8 model when its config.json carries `quantization_config: {quant_method: fp8, fmt:
e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}` (its `Fp8Config`; block FP8 requires an
FP8-serialized checkpoint: e4m3 `*.weight` plus fp32 `*.weight_scale_inv`). The trainer publishes BF16 and
our loader quantizes while it copies, so unlike the BF16 check the trainer here publishes canonical pieces
(checkpoint names, with their shards) after writing its `TrainerRecord` into the meta-store, as the
Megatron `Publisher` does: the loader's automatic wiring reads the engine's `quantization_config` and finds
each e4m3 parameter and its `weight_scale_inv` (runtime/sglang/auto.py, convert/fp8.py `read_fp8`). With
tensor parallelism 1 on both sides a canonical piece is a whole checkpoint tensor (q_proj, experts.E.up_proj).

What SGLang should hold after a step (`expected_state`): every BF16 parameter as published, and every block-
FP8 parameter the reference quantizer's e4m3 values and scales (colocated/fp8_block.py) of the fused BF16
parameter. What a checkpoint of those weights holds (`fp8_checkpoint`): each quantized canonical piece as
e4m3 `*.weight` plus `*.weight_scale_inv` from the same quantizer, the rest BF16, as an offline converter
(slime's tools/convert_hf_to_fp8.py) writes it. Every fused part (q/k/v, gate/up, each expert) is whole
128-row blocks (SGLang refuses other block-FP8 layouts), so quantizing the pieces and quantizing the fused
parameter give the same bytes (`tests/sglang_gpu/test_fp8_check.py` checks it).

SGLang 0.5.17's post-load step of block FP8 (`Fp8LinearMethod.process_weights_after_loading_block_quant`,
`Fp8MoEMethod.process_weights_after_loading_block_quant`, layers/quantization/fp8.py): on CUDA without ROCm,
AMX or MXFP8, the only rewrite is `requant_block_scale_ue8m0_for_deepgemm` (fp8_utils.py), which requantizes
weight and scales to UE8M0 in place only when the DeepGEMM runner is selected and
`should_deepgemm_weight_requant_ue8m0` holds (DEEPGEMM_SCALE_UE8M0: DeepGEMM on sm100). On the H200 the
linear runner is Triton's `triton_w8a8_block_fp8_linear` (DeepGEMM off: `SGLANG_ENABLE_JIT_DEEPGEMM=0`, no
`deep_gemm` package carried, and `--fp8-gemm-backend triton`), the MoE runner Triton's fused MoE, and both
read `weight` / `weight_scale_inv` as loaded: the post-load step leaves them as they are (`layer.weight.data =
weight.data`, the same storage), and no derived copy of a scale exists to go stale. The `fp8_info` probe
reports what the engine chose; the second server, loaded from an FP8 checkpoint through SGLang's whole loader
(load_weights and then process_weights_after_loading), is compared bitwise with our install.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from colocate_runtime.colocated.fp8_block import BlockFp8, quantize
from colocate_runtime.convert import (
    MegatronLayout,
    MegatronRank,
    SGLangLayout,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.convert.fp8 import Fp8Quantization, fp8_quantization, is_quantized, scale_name
from colocate_runtime.convert.inference import InferenceRankPlan
from colocate_runtime.convert.published import TrainerRecord, dims_of
from colocate_runtime.convert.trainer import TrainerRankPlan
from colocate_runtime.shards import TensorShard

# SGLang's block-FP8 config (what DeepSeek-V3's and Qwen3-*-FP8's config.json carry)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# SGLang's server flag and environment for block FP8 on the H200: Triton's block-FP8 GEMM, never DeepGEMM
# (not carried; sglang/srt/layers/deep_gemm_wrapper/configurer.py reads SGLANG_ENABLE_JIT_DEEPGEMM).
SERVER_FLAGS = ("--fp8-gemm-backend", "triton")
ENVIRONMENT = {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}


def tiny_fp8(base: Mapping[str, Any], **dims: Any) -> dict[str, Any]:
    """A tiny BF16 config made block FP8: every quantized linear's dimensions whole 128-blocks."""
    return {**base, **dims, "quantization_config": dict(QUANTIZATION_CONFIG)}


def is_fp8(config: Mapping[str, Any]) -> bool:
    return bool(config.get("quantization_config"))


def quantization(config: Mapping[str, Any]) -> Fp8Quantization:
    quant = fp8_quantization(config)
    if quant is None:
        raise ValueError("not a block-FP8 config")
    return quant


def plans(config: Mapping[str, Any]) -> tuple[TrainerRankPlan, InferenceRankPlan]:
    """The one trainer rank (Megatron TP 1) and the one SGLang worker (TP 1) of the check."""
    spec = model_spec(dict(config))
    return trainer_plan(spec, MegatronLayout(), MegatronRank()), inference_plan(spec, SGLangLayout(tp=1), 0)


def trainer_record(config: Mapping[str, Any]) -> str:
    """The record the Megatron Publisher writes under its GPU's UUID at start (runtime/megatron/publisher.py):
    what the loader's automatic wiring reads."""
    tplan, _ = plans(config)
    spec = tplan.spec
    return TrainerRecord(
        tplan.layout, tplan.rank, spec.dtype, spec.architecture, dims=dims_of(spec)
    ).to_json()


def shards(config: Mapping[str, Any]) -> dict[str, TensorShard]:
    """The canonical pieces the trainer rank publishes, by name (checkpoint names: whole tensors at TP 1)."""
    tplan, _ = plans(config)
    return {s.name: s for s in tplan.shards()}


def trained(config: Mapping[str, Any], seed: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """The trainer's BF16 weights after step `seed`, one per canonical piece: norms near 1, the rest small
    normal (bench/sglang_gpu.py `trained`, on canonical pieces)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shard in sorted(shards(config).items()):
        t = torch.randn(shard.box.lengths, generator=g, device=device, dtype=torch.float32)
        t = 1 + 0.1 * t if name.endswith("norm.weight") else 0.05 * t
        out[name] = t.to(torch.bfloat16)
    return out


def quantized_pieces(config: Mapping[str, Any]) -> set[str]:
    """The canonical pieces SGLang holds in block FP8 (parts of its e4m3 parameters)."""
    _, iplan = plans(config)
    quant = quantization(config)
    return {
        p.shard.name for param in iplan.params if is_quantized(param.name, quant) for p in param.placements
    }


def expected_state(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What SGLang's parameters must hold after an install of `weights` (canonical BF16 pieces), on the CPU:
    BF16 parameters as published, block-FP8 ones (and their `*_scale_inv`) the reference quantizer's output
    of the fused BF16 parameter."""
    _, iplan = plans(config)
    quant = quantization(config)
    fmt = BlockFp8(quant.block)
    fused = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in iplan.param_shapes().items()}
    placed = set()
    for shard, view in iplan.read(fused):
        view.copy_(weights[shard.name].cpu())
        placed.add(shard.name)
    missing = sorted(set(weights) ^ placed)
    if missing:
        raise ValueError(f"the published pieces and SGLang's parameters differ: {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        if is_quantized(name, quant):
            out[name], out[scale_name(name)] = quantize(t, fmt)
        else:
            out[name] = t
    return out


def fp8_checkpoint(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (canonical BF16 pieces) as a block-FP8 checkpoint, on the CPU: each quantized piece as e4m3
    `*.weight` and fp32 `*.weight_scale_inv` (the reference quantizer), the rest (embedding, lm_head, norms,
    the MoE router) BF16: what SGLang's `load_weights` and a server started from it read."""
    quant = quantization(config)
    fmt = BlockFp8(quant.block)
    fp8 = quantized_pieces(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name in fp8:
            out[name], out[scale_name(name)] = quantize(t.cpu(), fmt)
        else:
            out[name] = t.cpu().contiguous()
    return out


def engine_check(info: Mapping[str, Any], params: Mapping[str, Mapping[str, Any]]) -> tuple[bool, dict]:
    """The `fp8_info` probe's report on a block-FP8 engine, judged: SGLang read our quantization_config, its
    FP8 layers (Fp8LinearMethod / Fp8MoEMethod) hold e4m3 weights with fp32 `*_scale_inv`, no scale is
    UE8M0 and no layer holds a tensor derived from them. `params`: the `meta` probe's table. (ok, detail)."""
    layers = {n: x for n, x in info["layers"].items() if x.get("block_quant")}
    derived = {n: x["derived"] for n, x in layers.items() if x.get("derived")}
    ue8m0 = {n: x["ue8m0"] for n, x in layers.items() if any(x.get("ue8m0", {}).values())}
    seen = info.get("quantization_config")
    seen = seen if isinstance(seen, dict) else {"unreadable": seen}
    held = {
        f"{n}.{w}": (params[f"{n}.{w}"]["dtype"], params.get(f"{n}.{w}_scale_inv", {}).get("dtype"))
        for n in layers
        for w in ("weight", "w13_weight", "w2_weight")
        if f"{n}.{w}" in params
    }
    ok = (
        bool(layers)
        and all(seen.get(k) == v for k, v in QUANTIZATION_CONFIG.items())
        and bool(held)
        and all(d == ("float8_e4m3fn", "float32") for d in held.values())
        and not derived
        and not ue8m0
    )
    detail = {
        "layers": len(layers),
        "weights": len(held),
        "not_e4m3_fp32": {n: d for n, d in held.items() if d != ("float8_e4m3fn", "float32")},
        "gemm": sorted({str(x["gemm"]) for x in layers.values() if "gemm" in x}),
        "moe_runner": sorted({str(x["moe_runner"]) for x in layers.values() if "moe_runner" in x}),
        "derived": derived,
        "ue8m0": ue8m0,
        "quantization_config": seen,
        "switches": info.get("switches"),
    }
    return ok, detail


def missing_piece(config: Mapping[str, Any], weights: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    """A step that must fail: the first layer's q_proj (part of an e4m3 parameter) not published, so the
    reader cannot fill `qkv_proj` (CoverageError) after it has quantized the rest. (weights, shards, name).
    Not the BF16 check's one-element-too-long norm: with target shards the reader copies the part of a
    published box that overlaps the target, so that step would install."""
    name = "model.layers.0.self_attn.q_proj.weight"
    given = shards(config)
    return (
        {n: t for n, t in weights.items() if n != name},
        {n: s for n, s in given.items() if n != name},
        name,
    )
