"""A megatron-core GPTModel built from a Hugging Face Qwen3 / Qwen3-MoE config, wrapped in Megatron's DDP
with the distributed optimizer, as a Megatron trainer builds it (local layer specs: no Transformer-Engine
needed, so the same code runs on CPU for the tests and on GPUs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def transformer_config(hf: dict[str, Any], tp: int, ep: int, dtype: torch.dtype) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = hf["model_type"] == "qwen3_moe"
    kwargs: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_query_groups": hf["num_key_value_heads"],
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "ffn_hidden_size": hf["intermediate_size"],
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf["rms_norm_eps"],
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "qk_layernorm": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "sequence_parallel": False,
        "bf16": dtype == torch.bfloat16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "use_cpu_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }
    if moe:
        kwargs |= {
            "num_moe_experts": hf["num_experts"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_token_dispatcher_type": "allgather",
            "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none",
        }
    return TransformerConfig(**kwargs)


def build_model(hf: dict[str, Any], *, tp: int, ep: int, dtype: torch.dtype, vocab_divisor: int) -> Any:
    """The rank's GPTModel in Megatron's DDP (distributed optimizer; the parameters are views of its
    contiguous buffers, which the colocated update reads in place)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(hf, tp, ep, dtype)
    padded = -(-hf["vocab_size"] // (vocab_divisor * tp)) * (vocab_divisor * tp)
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"),
        vocab_size=padded,
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=int(hf["rope_theta"]),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    ).to(dtype)
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=False, grad_reduce_in_fp32=True
    )
    return DistributedDataParallel(config, ddp, model)


def build_optimizer(model: Any, lr: float) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = model.config.bf16
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.0,
        bf16=bf16,
        params_dtype=model.config.params_dtype,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    return get_megatron_optimizer(config, [model])


def cpu_stand_ins() -> None:
    """What stands in for CUDA (and Transformer-Engine) on a machine without GPUs (the tests): megatron-core's
    device queries answer "cpu", the dropout RNG fork is a no-op (dropout is 0), and its optimizer, which
    creates its scalars on 'cuda' and accepts only `torch.cuda.*Tensor` parameters, gets CPU tensors reported
    under CUDA's type names. Nothing else changes; on GPUs none of this runs."""
    import contextlib
    import types

    from megatron.core import tensor_parallel, utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    tensor_parallel.get_cuda_rng_tracker().fork = lambda name=None: contextlib.nullcontext()
    # No Transformer-Engine here: 0.16's MoE router reads `te_general_gemm`, which its moe_utils defines only
    # when TE imports; None is what it means by "absent".
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def on_cpu(make: Any) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)

        return made

    cpu_torch = types.ModuleType("torch_on_cpu")
    cpu_torch.__dict__.update(vars(torch))
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(cpu_torch, name, on_cpu(getattr(torch, name)))
    for module in (optimizer, distrib_optimizer, clip_grads, utils):
        module.torch = cpu_torch  # type: ignore[attr-defined]
    plain_type = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
