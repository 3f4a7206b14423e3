"""One gloo rank that builds every case's real megatron-core GPTModel on CPU and saves what the test needs.

    PYTHONPATH=$(bash scripts/megatron-env.sh 0.16.1) RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29500 .venv/bin/python -m tests.megatron_real.worker OUT_DIR

For each case: Megatron's parallel_state at the case's TP/EP, a GPTModel from Megatron's local layer
specs (`get_gpt_decoder_block_spec(..., use_transformer_engine=False)`), deterministic random weights,
Megatron's own forward (logits gathered over TP by Megatron's mapping), and the rank's state dict; saved
to OUT_DIR/CASE/rankN.pt with the module classes the release's Transformer-Engine spec puts where.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.megatron_real.cases import BATCH, CASES, SEQ, VOCAB, WORLD_SIZE, Case, megatron_config


def cpu_stand_ins() -> None:
    """What Megatron only has for CUDA, replaced for this CPU process (nothing here changes a result):
    device queries answer "cpu" (RoPE and the router move tensors to `current_device()`); the dropout RNG
    fork is a no-op (dropout is 0 and the model is in eval mode). Two places misread a missing
    Transformer-Engine and are told the truth: 0.16's router reads `te_general_gemm`, which its moe_utils
    only defines when TE imports (it gets the None meaning "absent"); and MLA from 0.14 sets HAVE_TE because
    Megatron's TE extension imports without TE (as placeholders), then fails on `isinstance(x, TELinear)`.
    """
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import tensor_parallel
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    tensor_parallel.get_cuda_rng_tracker().fork = lambda name=None: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False


def fill(model: torch.nn.Module) -> None:
    """Deterministic random weights: a tensor every TP (or expert-TP) rank holds a different part of is seeded
    by its rank, an expert by its EP rank, and everything else (norms, router, duplicated projections) by name
    alone, so that replicas agree as Megatron keeps them."""
    from megatron.core import parallel_state as ps

    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        expert = ".experts." in name and ".shared_experts." not in name
        key = name
        if getattr(params.get(name), "tensor_model_parallel", False):
            tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            key += f"|tp{tp_rank}"
        if expert:
            key += f"|ep{ps.get_expert_model_parallel_rank()}"
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        values = torch.randn(tensor.shape, generator=gen, dtype=torch.float64)
        if name.endswith("layernorm.weight") or name.endswith("layer_norm_weight"):
            values = 1 + 0.1 * values
        elif tensor.dim() == 2 and "word_embeddings" not in name:
            values = values / tensor.shape[1] ** 0.5
        else:
            values = 0.5 * values
        with torch.no_grad():
            tensor.copy_(values.to(tensor.dtype))


def mla_core_attention() -> type:
    """Megatron's local MLA spec hands DotProductAttention `k_channels` and `v_channels`, which it does not
    take in any tested release (TE's attention does), so the local spec cannot build an MLA model as
    released. This subclass takes them and sizes its output by `v_channels`; the attention is Megatron's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int = 0, v_channels: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels:  # Megatron's base Attention builds one without them first, then MLA replaces it
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def te_spec(case: Case) -> dict[str, str]:
    """Class names Megatron's Transformer-Engine layer specs of this release use, by submodule path.

    Without Transformer-Engine, Megatron still defines its TE classes (as placeholders) and TESpecProvider;
    only `gpt_layer_specs` lacks the provider name, so it is handed over and the spec functions run as
    written, told that a current TE is installed (its version checks pass, and TE's grouped linear, which
    exists from TE 1.9, is there); the classes are then matched back to their names by identity."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import identity_op
    from megatron.core.transformer.moe import experts

    names: dict[int, str] = {}
    for module in (te_ext, experts, identity_op):
        for attr, value in vars(module).items():
            if attr[:1].isupper():
                names.setdefault(id(value), attr)
    grouped = getattr(te_ext, "TEColumnParallelGroupedLinear", None)
    if grouped is None:
        grouped = type("TEColumnParallelGroupedLinear", (), {})
        names[id(grouped)] = "TEColumnParallelGroupedLinear"
    provider.TEColumnParallelGroupedLinear = grouped
    provider.is_te_min_version = lambda *args, **kwargs: True
    gpt_layer_specs.TESpecProvider = provider.TESpecProvider
    mla = "q_lora_rank" in case.hf
    moe = "num_experts" in case.hf or "n_routed_experts" in case.hf

    def name(module: Any) -> str:
        module = getattr(module, "module", module)
        return names.get(id(module), getattr(module, "__name__", repr(module)))

    out: dict[str, str] = {}
    for kind, experts_count in (("dense", None), ("moe", 4 if moe else None)):
        if kind == "moe" and not moe:
            continue
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts_count, moe_grouped_gemm=True, qk_layernorm=True, multi_latent_attention=mla
        )
        layer = spec.submodules
        attn = layer.self_attention.submodules
        out[f"{kind}.input_layernorm"] = name(layer.input_layernorm)
        out[f"{kind}.pre_mlp_layernorm"] = name(layer.pre_mlp_layernorm)
        for field in vars(attn):
            out[f"{kind}.self_attention.{field}"] = name(getattr(attn, field))
        mlp = layer.mlp
        if kind == "moe":
            out["moe.mlp.experts"] = name(mlp.submodules.experts)
        else:
            out["dense.mlp.linear_fc1"] = name(mlp.submodules.linear_fc1)
    return out


def build(case: Case, **overrides: Any) -> tuple[torch.nn.Module, dict[str, int]]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    ps.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp,
    )
    kwargs = megatron_config(case.hf) | {
        "activation_func": F.silu,
        "tensor_model_parallel_size": case.tp,
        "expert_model_parallel_size": case.ep,
        "expert_tensor_parallel_size": case.etp,
        **overrides,
    }
    config = (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
    torch.manual_seed(0)
    model = GPTModel(
        config,
        block,
        vocab_size=case.padded_vocab,
        max_sequence_length=case.hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=int(case.hf["rope_theta"]),
        share_embeddings_and_output_weights=False,
    )
    coords = {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
    }
    return model.eval(), coords


def ddp_layout(model: torch.nn.Module) -> dict[str, Any]:
    """The rank's parameters as Megatron-core's DDP keeps them with the distributed optimizer: views of its
    contiguous per-dtype buffers (`param_data`). Saved without copies, so torch.save keeps the views sharing
    their buffer (the one-pass update reads that storage in place)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    buffers = [b.param_data for b in (*ddp.buffers, *ddp.expert_parallel_buffers) if b.param_data is not None]
    state = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {"ddp_state": state, "ddp_buffers": len(buffers)}


def legacy_grouped_state(case: Case) -> dict[str, torch.Tensor]:
    """The rank's state dict with `moe_grouped_gemm` on the local spec: Megatron's legacy GroupedMLP (all
    local experts in `experts.weight1`/`weight2`), a layout the converters refuse. Only built, never run, so
    its check for the grouped_gemm kernels (CUDA only) is skipped."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import experts

    check = experts.gg.assert_grouped_gemm_is_available
    experts.gg.assert_grouped_gemm_is_available = lambda: None
    try:
        model, _ = build(case, moe_grouped_gemm=True)
    finally:
        experts.gg.assert_grouped_gemm_is_available = check
    ps.destroy_model_parallel()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def run_case(case: Case, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model, coords = build(case)
    fill(model)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)  # True: masked
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids, positions, mask))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    record = {"state": state, "coords": coords, "ids": ids, "logits": logits, "te_spec": te_spec(case)}
    record["facade"] = facade_record(case, model)
    record.update(ddp_layout(model))
    ps.destroy_model_parallel()
    if case.legacy_grouped:
        record["legacy_state"] = legacy_grouped_state(case)
    (out / case.name).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / case.name / f"rank{dist.get_rank()}.pt")


def facade_record(case: Case, model: torch.nn.Module) -> str:
    """What colocate_runtime.megatron reads from this live rank (parallel_state and the model itself)."""
    from colocate_runtime.convert.published import TrainerRecord
    from colocate_runtime.convert.registry import model_spec
    from colocate_runtime.megatron.parallel import (
        layout_of,
        named_tensors,
        read_parallel_state,
        vocab_divisor,
    )

    state = read_parallel_state([model])
    spec = model_spec(case.hf)
    layout, rank = layout_of(spec, state, [named_tensors(model)], vocab_divisor(state, [model]))
    return TrainerRecord(layout, rank, spec.dtype, spec.architecture).to_json()


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    only = set(argv[1:])
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=WORLD_SIZE)
    cpu_stand_ins()
    for case in CASES:
        if not only or case.name in only:
            run_case(case, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
