"""Stand-in names of Megatron-LM's megatron.training.tokenizer.tokenizer (see ../__init__.py)."""

from megatron.training import unavailable

_vocab_size_with_padding = unavailable("tokenizer.tokenizer._vocab_size_with_padding")
