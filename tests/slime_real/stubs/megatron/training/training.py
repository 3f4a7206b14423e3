"""Stand-in names of Megatron-LM's megatron.training.training (see __init__.py)."""

from megatron.training import unavailable

get_model = unavailable("training.get_model")
