"""The model dimensions the rules need, independent of any parallel layout.

Each architecture module reads its Hugging Face config into a `ModelDims`; which layers are MoE or use
linear attention is decided there once, so the rules below only look at numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.shards import dtype_bytes


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    intermediate_size: int  # per routed expert
    layers: frozenset[int]  # global ids of the layers whose MLP is a MoE
    shared_intermediate_size: int = 0  # 0: no shared experts
    expert_bias: bool = False  # aux-loss-free routing bias (DeepSeek-V3, Bailing)
    router_dtype: str | None = None  # None: the model dtype

    def __post_init__(self) -> None:
        if self.router_dtype is not None:
            dtype_bytes(self.router_dtype)
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise UnsupportedLayoutError(f"MoE needs experts and an intermediate size, got {self}")


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries are projected directly (q_proj), not through q_a/q_b

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelDims:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # dense MLP layers
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    attention_output_bias: bool = False
    qk_norm: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    linear_attention_layers: frozenset[int] = field(default_factory=frozenset)
    lm_head_dtype: str | None = None  # None: the model dtype

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if self.lm_head_dtype is not None:
            dtype_bytes(self.lm_head_dtype)
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise UnsupportedLayoutError(f"{self.architecture}: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedLayoutError(
                f"{self.architecture}: {self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )

    @property
    def queries_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def require_moe(self) -> MoESpec:
        if self.moe is None:
            raise UnsupportedLayoutError(f"{self.architecture}: the model spec has no MoE section")
        return self.moe

    def require_mla(self) -> MLASpec:
        if self.mla is None:
            raise UnsupportedLayoutError(f"{self.architecture}: the model spec has no MLA section")
        return self.mla

    @property
    def router_dtype(self) -> str:
        return (self.moe and self.moe.router_dtype) or self.dtype

    @property
    def output_dtype(self) -> str:
        return self.lm_head_dtype or self.dtype
