"""The tiny models and parallel layouts the real-Megatron tests build: one statement per case, read by the
Megatron worker (its TransformerConfig) and by the test (the Hugging Face config and our MegatronLayout).

Every case runs on two gloo ranks; a TP 1 / EP 1 case is two data-parallel replicas of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WORLD_SIZE = 2
VOCAB = 250  # the real vocabulary; Megatron pads it to a multiple of DIVISOR * tp
DIVISOR = 8  # make_vocab_size_divisible_by
BATCH, SEQ = 2, 12
RELEASES = ("0.13.1", "0.14.0", "0.16.1")  # the pins of scripts/megatron-env.sh

_COMMON_HF: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "dtype": "float32",
}

QWEN3 = {
    **_COMMON_HF,
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
}
DEEPSEEK_V3 = {
    **_COMMON_HF,
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_interleave": True,  # Megatron's MLA takes the rotary half of q/k interleaved, as DeepSeek does
    "rope_scaling": None,
}
DEEPSEEK_V2_LITE = {**DEEPSEEK_V3, "q_lora_rank": None}  # queries projected directly (linear_q_proj)


def megatron_config(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keywords (minus the parallel sizes) for the model `hf` describes."""
    config: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": hf["num_attention_heads"],
        "ffn_hidden_size": hf["intermediate_size"],
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf["rms_norm_eps"],
        "gated_linear_unit": True,  # activation_func (silu) is set by the worker
        "add_bias_linear": False,
        "qk_layernorm": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }
    if hf["model_type"] in ("qwen3", "qwen3_moe"):
        config |= {"num_query_groups": hf["num_key_value_heads"], "kv_channels": hf["head_dim"]}
    if hf["model_type"] == "qwen3_moe":
        config |= {
            "num_moe_experts": hf["num_experts"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        }
    if hf["model_type"] == "deepseek_v3":
        dense = hf["first_k_dense_replace"]
        config |= {
            "multi_latent_attention": True,
            "q_lora_rank": hf["q_lora_rank"],
            "kv_lora_rank": hf["kv_lora_rank"],
            "qk_head_dim": hf["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
            "v_head_dim": hf["v_head_dim"],
            "rope_type": "rope",
            "rotary_base": hf["rope_theta"],
            "rotary_scaling_factor": 1.0,  # no YaRN: softmax scale 1 / sqrt(q head dim), as in HF
            "num_moe_experts": hf["n_routed_experts"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": hf["moe_intermediate_size"] * hf["n_shared_experts"],
            "moe_layer_freq": [0] * dense + [1] * (hf["num_hidden_layers"] - dense),
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": hf["routed_scaling_factor"],
        }
    if "num_moe_experts" in config:
        config |= {
            "moe_token_dispatcher_type": "allgather",  # alltoall makes CUDA streams
            "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none",
        }
    return config


@dataclass(frozen=True)
class Case:
    name: str
    hf: dict[str, Any] = field(hash=False)
    tp: int = 1
    ep: int = 1
    etp: int | None = None  # None: Megatron's default (= tp)
    legacy_grouped: bool = False  # also save the state dict of Megatron's legacy GroupedMLP experts

    @property
    def padded_vocab(self) -> int:
        multiple = DIVISOR * self.tp
        return -(-VOCAB // multiple) * multiple


CASES = (
    Case("qwen3-tp1", QWEN3),
    Case("qwen3-tp2", QWEN3, tp=2),
    Case("qwen3_moe-ep2", QWEN3_MOE, ep=2, legacy_grouped=True),
    Case("qwen3_moe-tp2", QWEN3_MOE, tp=2),
    Case("deepseek_v3-ep2", DEEPSEEK_V3, ep=2),
    Case("deepseek_v3-tp2", DEEPSEEK_V3, tp=2),
    Case("deepseek_v2_lite-tp2", DEEPSEEK_V2_LITE, tp=2),
)
