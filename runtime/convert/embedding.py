"""Vocabulary-parallel weights (input embedding, lm_head), tied embeddings and the final norm.

The canonical vocabulary is the Hugging Face one: Megatron pads it to a multiple of divisor * TP, SGLang to a
multiple of 64, so the padded rows never leave a rank. Sharding follows the weight's role, not its name: a
model whose SGLang embedding is called `word_embeddings` keeps the embedding rules (the seed lost them by
renaming).
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_runtime.convert.architecture import Block
from colocate_runtime.convert.boxes import vocab_box
from colocate_runtime.convert.direct import Direct
from colocate_runtime.convert.layout import Group, RankGroups
from colocate_runtime.convert.params import CanonicalTensor, Extract, MegatronParam, Piece, SGLangParam, plain
from colocate_runtime.convert.spec import ModelDims
from colocate_runtime.shards import Box

EMBED_TOKENS = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class VocabParallel:
    tensor: CanonicalTensor
    megatron_name: str
    sglang_name: str
    output: bool = False  # lm_head: its own group and padding on SGLang (dp-lm-head)

    def _group(self, groups: RankGroups) -> tuple[Group, int]:
        if self.output:
            return groups.lm_head, groups.lm_head_rows
        return groups.embedding, groups.embedding_rows

    def _box(self, groups: RankGroups) -> tuple[Box | None, int]:
        group, rows = self._group(groups)
        return vocab_box(self.tensor.name, self.tensor.shape, rows, group), rows // group.size

    def canonical(self) -> list[CanonicalTensor]:
        return [self.tensor]

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        box, local_rows = self._box(groups)
        pieces = () if box is None else (Piece(self.tensor.shard(box), real_rows(box.lengths[0])),)
        return [MegatronParam((self.megatron_name,), (local_rows, *self.tensor.shape[1:]), pieces)]

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        box, local_rows = self._box(groups)
        shard = None if box is None else self.tensor.shard(box)
        return [plain(self.sglang_name, shard, (local_rows, *self.tensor.shape[1:]))]


def real_rows(count: int) -> Extract:
    """A rank's real vocabulary rows come first; the rest is padding."""
    return lambda tensor: tensor[:count]


@dataclass(frozen=True)
class TiedOutputLayer:
    """lm_head shares the input embedding. With PP > 1 Megatron's last stage keeps a synchronised copy as
    `output_layer.weight`; it is dropped (the first stage's embedding is the source). SGLang ties lm_head to
    `embed_tokens`, so it has no separate parameter to fill."""

    shape: tuple[int, ...]  # local shape of the copy

    def canonical(self) -> list[CanonicalTensor]:
        return []

    def megatron(self, groups: RankGroups, at: str) -> list[MegatronParam]:
        local = (groups.lm_head_rows // groups.lm_head.size, *self.shape[1:])
        return [MegatronParam(("output_layer.weight",), local, (), optional=True)]

    def sglang(self, groups: RankGroups) -> list[SGLangParam]:
        return []


def input_embedding(spec: ModelDims, sglang_name: str = EMBED_TOKENS) -> list[Block]:
    tensor = CanonicalTensor(EMBED_TOKENS, (spec.vocab_size, spec.hidden_size), spec.dtype)
    return [VocabParallel(tensor, "embedding.word_embeddings.weight", sglang_name)]


def output_head(spec: ModelDims) -> list[Block]:
    """Final norm and lm_head (or the tied alias)."""
    norm = CanonicalTensor("model.norm.weight", (spec.hidden_size,), spec.dtype)
    blocks: list[Block] = [Direct(norm, ("decoder.final_layernorm.weight",), norm.name)]
    shape = (spec.vocab_size, spec.hidden_size)
    if spec.tie_word_embeddings:
        blocks.append(TiedOutputLayer(shape))
    else:
        tensor = CanonicalTensor(LM_HEAD, shape, spec.output_dtype)
        blocks.append(VocabParallel(tensor, "output_layer.weight", LM_HEAD, output=True))
    return blocks
