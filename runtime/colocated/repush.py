"""Engine recovery without a training restart: the trainer pushes its current weights again to a restarted
SGLang side.

When only the SGLang container exits, the kubelet restarts it in place (the operator's container restart
rules) and the trainer keeps running; the new engine starts from the model's checkpoint, not from the
trainer's current weights. Each SGLang-side process registers when it starts (`MetaStore.register_engine`: a
new engine instance number for its GPU, `{p}:engine:{uuid}`; sglang/loader.py does it from the plugin or the
init call). The trainer's `EngineWatch` remembers the instance its last installed step reached and, asked at
a step boundary (one GET), says when another instance serves the GPU. The trainer then publishes its latest
step once more (`push_again`: the same step number and trainer generation, the step's keys cleared first)
with the weights it holds now, and installs it like any step: no training step, no new trainer incarnation,
and nothing the operator counts twice (a step already complete is not counted again).

Trainer side only: above the writer in the layers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.colocated.writer import PendingStep, WeightWriter
from colocate_runtime.shards import TensorShard


class EngineWatch:
    """Which SGLang-side instance on the writer's GPU holds the trainer's weights, and whether another one
    serves the GPU now."""

    def __init__(self, writer: WeightWriter) -> None:
        self.store = writer.store
        self.uuid = writer.uuid
        self.served: int | None = None  # the instance the last installed step reached

    def current(self) -> int | None:
        return self.store.engine_instance(self.uuid)

    def mark(self) -> None:
        """Call once a step is installed: the instance serving now holds the trainer's weights."""
        self.served = self.current()

    def restarted(self) -> bool:
        """Another instance serves the GPU than the one the last installed step reached. False before any
        step was installed (the engine then still holds the weights both sides started from)."""
        if self.served is None:
            return False
        now = self.current()
        return now is not None and now != self.served

    def wait_restarted(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Wait until a restarted instance has registered (it does so as it starts); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.restarted():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True


def push_again(
    writer: WeightWriter,
    tensors: Mapping[str, torch.Tensor],
    *,
    shards: Mapping[str, TensorShard] | None = None,
    weight_version: str | None = None,
) -> PendingStep:
    """Publish the last step again with `tensors` (the trainer's current weights); wait on it as on any step
    (`writer.wait_and_free`)."""
    step = writer.republish()
    return writer.publish(step, tensors, shards=shards, weight_version=weight_version, again=True)


def push_again_in_place(
    writer: WeightWriter,
    layout: InPlaceLayout,
    *,
    weight_version: str | None = None,
    keep_mapped: bool = False,
) -> PendingStep:
    """`push_again` straight from the trainer's storage (`writer.publish_in_place`)."""
    step = writer.republish()
    return writer.publish_in_place(
        step, layout, weight_version=weight_version, again=True, keep_mapped=keep_mapped
    )
