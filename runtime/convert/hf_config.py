"""Reading Hugging Face config dicts: one place that knows dtype spellings and reports missing keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colocate_runtime.convert.errors import ConvertError

# Spellings found in HF configs (`dtype`/`torch_dtype`) and in Bailing's `router_dtype`.
_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
}


def require(config: Mapping[str, Any], *keys: str) -> Any:
    """The first of `keys` present (config files and transformers releases spell some fields differently)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    model_type = config.get("model_type", "?")
    raise ConvertError(f"Hugging Face config (model_type {model_type!r}) has none of {list(keys)}")


def dtype_name(value: object, default: str = "bfloat16") -> str:
    if value is None:
        return default
    name = str(value).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def optional_dtype(value: object) -> str | None:
    return None if value is None else dtype_name(value)


def model_dtype(config: Mapping[str, Any]) -> str:
    return dtype_name(config.get("dtype") or config.get("torch_dtype"))


def head_dim(config: Mapping[str, Any]) -> int:
    return int(
        config.get("head_dim") or require(config, "hidden_size") // require(config, "num_attention_heads")
    )
