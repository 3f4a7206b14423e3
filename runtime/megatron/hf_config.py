"""The Hugging Face config both sides build the model spec from (`COLOCATE_MODEL_CONFIG`, or given)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from colocate_runtime.convert.errors import ConvertError

HFConfig = Mapping[str, Any] | str | os.PathLike[str] | Any


def load_hf_config(ref: HFConfig) -> dict[str, Any]:
    """A config dict from a mapping, a transformers config, a `config.json` path or the folder holding it,
    or (with transformers installed) a Hub id."""
    if isinstance(ref, Mapping):
        return dict(ref)
    if hasattr(ref, "to_dict"):
        return dict(ref.to_dict())
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return dict(json.loads(path.read_text()))
        except ValueError as err:
            raise ConvertError(f"{path} is not a JSON config: {err}") from err
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConvertError(
            f"model config {str(ref)!r}: no such file or folder (and transformers is not installed to read a "
            "Hub id); set COLOCATE_MODEL_CONFIG to the folder SGLang's --model-path names"
        ) from None
    return dict(AutoConfig.from_pretrained(str(ref)).to_dict())
