"""One colocated step, seen from the rollout engine: what the adapter asks SGLang, in which order.

`start()`, once, before the trainer's writer starts: detect the engine's version (versions.py), check its
arguments (our loaders registered, one data-parallel replica), learn its TP size, and make every TP worker
start its IPC preflight responder (the init call; the plugin may have done it already).

Before training: pause generation (in the mode this version survives a release with) and release every
memory tag (the trainer needs the GPU). After the trainer published its buckets, `install_weights`: resume the
weights region, let SGLang's workers run the colocated reader (through `/update_weights_from_tensor` with our
custom loader, inside a weight-update session where the version needs one), and then ask the trainer's
side whether the step succeeded (`confirm`, usually the writer's `wait_and_free`).
Only then set the weight version, resume the KV cache and CUDA graphs and continue generation. A failed step
leaves the engine paused with the weights resumed, so nothing is served from half-written weights; the caller
publishes again and calls `install_weights` again. Release and resume go through the client's tag tracking,
so a retried cycle never pauses a region twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from colocate_runtime.sglang.client import SGLangClient, SGLangError
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH

log = logging.getLogger(__name__)
T = TypeVar("T")

# What SGLang's `MultiprocessingSerializer.serialize([], output_str=True)` gives: an empty named-tensor list
# (base64 of a pickled `[]`). The colocated loader reads the meta-store, so this is all a request carries,
# and the trainer image needs no `sglang` to build it.
EMPTY_PAYLOAD = "gARdlC4="
# What `release_weights=False` releases for training: everything but the weights.
TRAINING_TAGS = ("kv_cache", "cuda_graph")


class StepNotInstalled(SGLangError):
    """The step failed on the trainer's or the reader's side; generation stays paused (cause chained)."""


class ColocatedRollout:
    def __init__(
        self,
        client: SGLangClient,
        *,
        tp_size: int | None = None,
        load_format: str = LOADER_PATH,
        init_load_format: str | None = INIT_LOADER_PATH,
        pause_mode: str | None = None,
        release_weights: bool = True,
    ) -> None:
        """`tp_size` and `pause_mode`: by default from the engine (`/server_info`) and its version.
        `release_weights=False` keeps SGLang's weights on the GPU while the trainer runs (only the KV cache
        and CUDA graphs are released): for a trainer that fits beside them, it saves the unmap and remap of
        the weights, most of an update's time on a large model (Qwen3-30B-A3B on an H200: 185 -> 70 ms,
        docs/benchmarks.md)."""
        self.client = client
        self.tp_size = tp_size
        self.load_format = load_format
        self.init_load_format = init_load_format
        self.pause_mode = pause_mode
        self.release_tags: list[str] | None = None if release_weights else list(TRAINING_TAGS)

    def start(self) -> None:
        """Detect and check the engine, then start its workers' colocated side. Call before the trainer's
        writer starts (its preflight waits for the workers)."""
        engine = self.client.detect()
        info = self.client.server_info
        registered = info.get("custom_weight_loader")
        if registered is not None and self.load_format not in registered:
            raise SGLangError(
                f"SGLang was started without `--custom-weight-loader {self.load_format}` "
                f"(it has {registered}): the colocated update cannot run"
            )
        dp = int(info.get("dp_size") or 1)
        if dp > 1 and not info.get("enable_dp_attention"):
            raise SGLangError(
                f"SGLang runs {dp} data-parallel replicas (--dp-size {dp}); update_weights_from_tensor "
                "supports one: run one SGLang server per replica"
            )
        if self.tp_size is None:
            self.tp_size = int(info.get("tp_size") or 1)
        if self.init_load_format is None:
            return
        if registered is not None and self.init_load_format not in registered:
            if not engine.plugins:
                raise SGLangError(
                    f"SGLang {engine.version} loads no plugins: add `--custom-weight-loader "
                    f"{self.init_load_format}` so the workers can answer the trainer's IPC preflight"
                )
            log.info(
                "init loader not registered; SGLang %s starts the workers through the plugin", engine.version
            )
            return
        self.client.update_weights_from_tensor(
            self._payloads(), load_format=self.init_load_format, weight_version=None, flush_cache=False
        )

    def before_training(self) -> None:
        self.client.pause_generation(self.pause_mode)
        self.client.release_memory_occupation(self.release_tags)  # None: every tag

    def install_weights(self, weight_version: str, *, confirm: Callable[[], T]) -> T:
        """Call once the trainer has published the step; `confirm` raises if the step failed (for one GPU:
        `lambda: writer.wait_and_free(pending)`; for several, whatever gathers their writers' outcomes).
        Returns what `confirm` returned; raises StepNotInstalled, with generation still paused, on failure."""
        self.client.resume_memory_occupation(["weights"])
        # SGLang answers success whatever the loader met (it must not raise): the version is set only after
        # `confirm`, so the engine never reports weights it does not hold.
        self.client.update_weights_from_tensor(
            self._payloads(), load_format=self.load_format, weight_version=None, flush_cache=False
        )
        try:
            outcome = confirm()
        except Exception as err:
            raise StepNotInstalled(
                f"weights {weight_version!r} not installed ({type(err).__name__}: {err}); generation stays "
                "paused: publish the step again and call install_weights again"
            ) from err
        self.client.update_weight_version(weight_version)
        self.client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        self.client.continue_generation()
        return outcome

    def _payloads(self) -> list[str]:
        if self.tp_size is None:
            self.start()  # learns the TP size
        return [EMPTY_PAYLOAD] * int(self.tp_size or 1)
