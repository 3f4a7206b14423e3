from . import megatron_chunked_grad_coalesce_patch  # noqa: F401
