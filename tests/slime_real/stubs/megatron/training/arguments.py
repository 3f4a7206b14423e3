"""Stand-in names of Megatron-LM's megatron.training.arguments (see __init__.py)."""

from megatron.training import unavailable

validate_args = unavailable("arguments.validate_args")
parse_args = unavailable("arguments.parse_args")
core_transformer_config_from_args = unavailable("arguments.core_transformer_config_from_args")
