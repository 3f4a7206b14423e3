"""The trainer side of a colocated job for megatron-core trainers: one object built from the model chunks the
trainer already has, one call per step on every rank (`publisher.py`)."""

from colocate_runtime.megatron.agree import RankFailed
from colocate_runtime.megatron.publisher import Publisher

__all__ = ["Publisher", "RankFailed"]
