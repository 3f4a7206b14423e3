"""Stand-in names of Megatron-LM's megatron.training.checkpointing (see __init__.py)."""

from megatron.training import unavailable

save_checkpoint = unavailable("checkpointing.save_checkpoint")
load_checkpoint = unavailable("checkpointing.load_checkpoint")
get_load_checkpoint_path_by_args = unavailable("checkpointing.get_load_checkpoint_path_by_args")
