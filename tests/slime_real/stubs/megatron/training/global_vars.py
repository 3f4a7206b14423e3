"""Stand-in names of Megatron-LM's megatron.training.global_vars (see __init__.py)."""

from megatron.training import unavailable

_build_tokenizer = unavailable("global_vars._build_tokenizer")
set_args = unavailable("global_vars.set_args")
get_args = unavailable("global_vars.get_args")
