"""Stand-in for Megatron-LM's `megatron.training` (tests/slime_real/README.md says why).

Megatron-LM's training package is not on PyPI: the `megatron-core` wheel ships `megatron.core` only, and
slime imports `megatron.training` at module level (checkpointing, global_vars, training). These modules give
those names so slime's own modules import; every function raises if called. The slime tests never call them:
they build the model with megatron-core directly and drive slime's weight-update code, which needs none.
"""


def unavailable(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"megatron.training.{name} is a stand-in (Megatron-LM's training package is not on PyPI)"
        )

    call.__name__ = name.rsplit(".", 1)[-1]
    return call
