"""One colocated step, seen from the rollout engine: what the adapter asks SGLang, in which order.

Before training: pause generation and release every memory tag (the trainer needs the GPU). After the
trainer published its buckets: resume the weights region, let SGLang's workers run the colocated reader
(through `/update_weights_from_tensor` with our custom loader, carrying the weight version, so version and
data change together), then resume the KV cache and CUDA graphs, flush the cache and continue generation.
Release and resume go through the client's tag tracking, so a retried cycle never pauses a region twice.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

from colocate_runtime.sglang.client import SGLangClient
from colocate_runtime.sglang.loader import LOADER_PATH

PayloadEncoder = Callable[[int], str]


def json_payload(tp_rank: int) -> str:
    """The stand-in's payload: base64 of a JSON list of named tensors (empty: the loader reads Redis)."""
    return base64.b64encode(json.dumps([]).encode()).decode()


def sglang_payload(tp_rank: int) -> str:
    """Real SGLang decodes payloads with its own serializer; an empty named-tensor list in its format."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]
    except ImportError as err:
        raise RuntimeError(
            "sglang is not installed in this container: use json_payload with the stand-in"
        ) from err
    return MultiprocessingSerializer.serialize([], output_str=True)


class ColocatedRollout:
    def __init__(
        self,
        client: SGLangClient,
        *,
        tp_size: int = 1,
        load_format: str = LOADER_PATH,
        payload: PayloadEncoder = sglang_payload,
        pause_mode: str = "retract",
    ) -> None:
        self.client = client
        self.tp_size = tp_size
        self.load_format = load_format
        self.payload = payload
        self.pause_mode = pause_mode

    def before_training(self) -> None:
        self.client.pause_generation(self.pause_mode)
        self.client.release_memory_occupation(None)

    def install_weights(self, weight_version: str) -> str:
        """Call once the trainer has published the step; returns SGLang's message."""
        self.client.resume_memory_occupation(["weights"])
        message = self.client.update_weights_from_tensor(
            [self.payload(r) for r in range(self.tp_size)],
            load_format=self.load_format,
            weight_version=weight_version,
            flush_cache=False,
        )
        self.client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        self.client.flush_cache()
        self.client.continue_generation()
        return message
