"""SGLang's block-FP8 layout: which parameters an engine serving a block-FP8 checkpoint config holds as e4m3
weights with fp32 block scales, and their shapes, as a pure function of the model config and the layout.

SGLang (0.5.10 and 0.5.23 alike) reads `quantization_config: {quant_method: fp8, weight_block_size: [bn, bk],
fmt: e4m3, activation_scheme: dynamic}` into its `Fp8Config`; every `LinearBase` layer then gets
`Fp8LinearMethod.create_weights` (layers/quantization/fp8.py): `weight` e4m3 of the BF16 local shape plus
`weight_scale_inv` fp32 [ceil(N / bn), ceil(K / bk)] (a `BlockQuantScaleParameter`), and every FusedMoE gets
`Fp8MoEMethod`: `w13_weight` / `w2_weight` e4m3 plus `w13_weight_scale_inv` [E, ceil(2 I / bn), ceil(H / bk)]
and `w2_weight_scale_inv` [E, ceil(H / bn), ceil(I / bk)]. For Qwen3 and Qwen3-MoE that is `qkv_proj`,
`o_proj`, `gate_up_proj`, `down_proj` and the experts. BF16 stay: the embedding and `lm_head` (vocabulary
layers, not LinearBase), the norms, and the MoE router `mlp.gate` (a `ReplicatedLinear` built with
`quant_config=None`). Modules named in `ignored_layers` / `modules_to_not_convert` stay BF16 too.

SGLang refuses (`validate_block_quant_shapes`) a fused or column-parallel weight whose per-rank output parts
are not multiples of bn, and a row-parallel weight at TP > 1 whose per-rank input is not a multiple of bk; so
every SGLang-side block lies inside one canonical piece of one rank: `fp8_layout` checks the same.

The scales' values follow colocated/fp8_block.py (fp32, or UE8M0 where SGLang's DeepGEMM path asks for it:
`Fp8Quantization.ue8m0`, a property of the engine's GPU, not of the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.inference import InferenceRankPlan
from colocate_runtime.convert.params import Placement, SGLangParam
from colocate_runtime.shards import Box

FP8_BLOCK_FORMAT = "fp8_e4m3_block128"  # colocated.fp8_block.FORMAT: the target dtype of step_bench lines
E4M3 = "float8_e4m3fn"
SCALE_DTYPE = "float32"
ARCHITECTURES = ("qwen3", "qwen3_moe")  # checked against SGLang's own FP8 classes (tests/sglang_real)
# The SGLang parameters of LinearBase / FusedMoE layers in these architectures.
QUANTIZED_SUFFIXES = (
    ".self_attn.qkv_proj.weight",
    ".self_attn.o_proj.weight",
    ".mlp.gate_up_proj.weight",
    ".mlp.down_proj.weight",
    ".mlp.experts.w13_weight",
    ".mlp.experts.w2_weight",
)


@dataclass(frozen=True, slots=True)
class Fp8Quantization:
    block: tuple[int, int] = (128, 128)
    ignored: tuple[str, ...] = ()  # module prefixes kept in the model dtype
    ue8m0: bool = False  # power-of-two scales (SGLang's DeepGEMM on sm100 / sm120): the engine's choice

    @property
    def target_dtype(self) -> str:
        return (
            FP8_BLOCK_FORMAT if self.block == (128, 128) else f"fp8_e4m3_block{self.block[0]}x{self.block[1]}"
        )


def fp8_quantization(hf_config: Mapping[str, Any]) -> Fp8Quantization | None:
    """The block-FP8 config of a model's config.json (None: the engine holds the model dtype)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedLayoutError(
            f"quantization_config.quant_method {method!r}: only block 'fp8' is supported"
        )
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedLayoutError(
            "quantization_config: per-tensor FP8 (no weight_block_size) is not supported"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedLayoutError(f"quantization_config.fmt {fmt!r}: only e4m3 is supported")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":  # SGLang asserts it for block quantization
        raise UnsupportedLayoutError(
            f"quantization_config.activation_scheme {scheme!r}: block FP8 is dynamic"
        )
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return Fp8Quantization((int(block[0]), int(block[1])), ignored)


@dataclass(frozen=True, slots=True)
class HeldParam:
    """One parameter as the engine holds it: a BF16 one, an e4m3 weight (with `scale`), or a scale."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    scale: str | None = None  # an e4m3 weight's `*_scale_inv`
    scale_of: str | None = None  # a scale's weight


def scale_name(weight: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`, `experts.w13_weight` -> `experts.w13_weight_scale_inv`."""
    return f"{weight}_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def is_quantized(name: str, quant: Fp8Quantization) -> bool:
    if not name.endswith(QUANTIZED_SUFFIXES):
        return False
    return not any(name == p or name.startswith(p.rstrip(".") + ".") for p in quant.ignored)


def fp8_layout(plan: InferenceRankPlan, quant: Fp8Quantization) -> dict[str, HeldParam]:
    """Every parameter of one SGLang rank serving block FP8, by name (scales included), in plan order."""
    if plan.spec.architecture not in ARCHITECTURES:
        raise UnsupportedLayoutError(
            f"block-FP8 layout of {plan.spec.architecture!r} is not covered (only {', '.join(ARCHITECTURES)})"
        )
    held: dict[str, HeldParam] = {}
    for param in plan.params:
        if not is_quantized(param.name, quant):
            dtype = param.placements[0].shard.dtype if param.placements else plan.spec.dtype
            held[param.name] = HeldParam(param.name, param.shape, dtype)  # the router may be fp32
            continue
        _check_blocks(param, quant.block, plan.layout.tp > 1)
        scale = scale_name(param.name)
        held[param.name] = HeldParam(param.name, param.shape, E4M3, scale=scale)
        held[scale] = HeldParam(
            scale, scale_shape(param.shape, quant.block), SCALE_DTYPE, scale_of=param.name
        )
    return held


def _check_blocks(param: SGLangParam, block: tuple[int, int], sharded: bool) -> None:
    """SGLang's validate_block_quant_shapes, on the parameter's canonical placements: fused parts (and
    column-parallel rows) are whole row blocks; a row-parallel rank's columns are whole column blocks."""
    bn, bk = block
    for p in param.placements:
        rows_at, cols_at = p.offsets[-2], p.offsets[-1]
        rows, cols = p.shard.box.lengths[-2], p.shard.box.lengths[-1]
        row_split = p.shard.box.lengths[-2] != p.shard.global_shape[-2]
        col_split = p.shard.box.lengths[-1] != p.shard.global_shape[-1]
        fused = len(param.placements) > 1 and rows != param.shape[-2]
        if (fused or (sharded and row_split)) and (rows_at % bn or rows % bn):
            raise UnsupportedLayoutError(
                f"{param.name}: {p.shard.name} takes rows {rows_at}..{rows_at + rows}, not whole "
                f"{bn}-row blocks (SGLang refuses this block-FP8 layout)"
            )
        if sharded and col_split and (cols_at % bk or cols % bk):
            raise UnsupportedLayoutError(
                f"{param.name}: {p.shard.name} takes columns {cols_at}..{cols_at + cols}, not whole "
                f"{bk}-column blocks (SGLang refuses this block-FP8 layout)"
            )


def scale_target(placement: Placement, box: Box, block: tuple[int, int]) -> tuple[int | slice, ...]:
    """The scale tensor's index expression for the blocks a sub-box of a placement covers (the e4m3
    counterpart is `placement.target(box)`): the same leading index, rows and columns divided into blocks,
    a ragged last block counted whole."""
    *lead, rows, cols = placement.target(box)
    assert isinstance(rows, slice) and isinstance(cols, slice)

    def blocks(s: slice, size: int) -> slice:
        return slice(s.start // size, -(-s.stop // size))

    return (*lead, blocks(rows, block[0]), blocks(cols, block[1]))


def read_fp8(
    plan: InferenceRankPlan,
    params: Mapping[str, Any],
    quant: Fp8Quantization,
    boxes: Mapping[str, Box] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reader's targets of an engine serving block FP8: canonical name -> a view of its parameter (e4m3
    for quantized ones), and for the quantized ones canonical name -> the view of `*_scale_inv` covering the
    same blocks (`new_reader(targets, scales=...)`). `params`: the engine's tensors by SGLang name, scales
    included (`fp8_layout`'s names); `boxes`: the canonical sub-box to read of each (what the trainer rank
    on this GPU holds), else the whole placement."""
    targets: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    for param in plan.params:
        for p in param.placements:
            box = p.shard.box if boxes is None else boxes.get(p.shard.name)
            if box is None:
                continue
            targets[p.shard.name] = params[param.name][p.target(box)]
            if is_quantized(param.name, quant):
                scales[p.shard.name] = params[scale_name(param.name)][scale_target(p, box, quant.block)]
    return targets, scales
