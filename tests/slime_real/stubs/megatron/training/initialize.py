"""Stand-in names of Megatron-LM's megatron.training.initialize (see __init__.py)."""

from megatron.training import unavailable

_initialize_tp_communicators = unavailable("initialize._initialize_tp_communicators")
