"""What an architecture is to the converters: a config reader and the blocks of weights per stage.

A block owns a few related weights and states them three ways: their canonical tensors, the Megatron-core
tensors one trainer rank holds (with the boxes they cover), and the SGLang parameters one inference rank holds
(with where each canonical box lands). Keeping the three statements side by side keeps them consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from colocate_runtime.convert.layout import RankGroups
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, SGLangParam
from colocate_runtime.convert.spec import ModelDims


class Block(Protocol):
    def canonical(self) -> list[CanonicalTensor]: ...

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        """The rank's Megatron tensors; `at` prefixes layer-relative names (e.g. "decoder.layers.2.")."""
        ...

    def sglang(self, groups: RankGroups) -> list[SGLangParam]: ...


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    spec_from_hf: Callable[[Mapping[str, Any]], ModelDims]
    first_stage: Callable[[ModelDims], list[Block]]  # embedding: first pipeline chunk only
    layer: Callable[[ModelDims, int], list[Block]]  # decoder layer by global id
    last_stage: Callable[[ModelDims], list[Block]]  # final norm and output layer: last chunk only
