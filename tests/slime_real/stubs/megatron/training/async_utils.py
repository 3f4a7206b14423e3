"""Stand-in names of Megatron-LM's megatron.training.async_utils (see __init__.py)."""

from megatron.training import unavailable

maybe_finalize_async_save = unavailable("async_utils.maybe_finalize_async_save")
