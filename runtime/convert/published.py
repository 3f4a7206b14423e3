"""What a trainer rank publishes on its GPU, stated so the SGLang side can plan without a user module.

The trainer side (colocate_runtime.megatron) writes one `TrainerRecord` per GPU into the meta-store when it
starts; the SGLang loader (colocate_runtime.sglang.auto) reads the record of its own GPU at the first update
and rebuilds the trainer rank's plan from the engine's own model config: the two sides never exchange
tensors' names or boxes, only the Megatron layout and the rank's coordinates. Plain data, JSON both ways.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from colocate_runtime.convert.errors import ConvertError
from colocate_runtime.convert.layout import MegatronLayout, MegatronRank, PipelineLayout
from colocate_runtime.convert.spec import ModelDims

RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class TrainerRecord:
    """One trainer rank: the job-wide Megatron layout, the rank's coordinates and the dtype it publishes."""

    layout: MegatronLayout
    rank: MegatronRank
    dtype: str  # the canonical dtype of every published piece (the model's parameter dtype)
    architecture: str  # the converter family, checked against the engine's model config
    dims: dict[str, Any] | None = None  # the trainer's ModelDims (`dims_of`), checked against the engine's

    def to_json(self) -> str:
        layout = asdict(self.layout)
        if self.layout.pipeline is not None:
            layout["pipeline"] = [list(row) for row in self.layout.pipeline.layer_counts]
        return json.dumps(
            {
                "version": RECORD_VERSION,
                "layout": layout,
                "rank": asdict(self.rank),
                "dtype": self.dtype,
                "architecture": self.architecture,
                "dims": self.dims,
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str | bytes) -> TrainerRecord:
        try:
            data: dict[str, Any] = json.loads(text)
            if data.get("version") != RECORD_VERSION:
                raise ConvertError(
                    f"trainer record version {data.get('version')!r}, this runtime reads {RECORD_VERSION}: "
                    "run the same colocate_runtime in the trainer and SGLang images"
                )
            layout = dict(data["layout"])
            if layout.get("pipeline") is not None:
                layout["pipeline"] = PipelineLayout(tuple(tuple(row) for row in layout["pipeline"]))
            return TrainerRecord(
                layout=MegatronLayout(**layout),
                rank=MegatronRank(**data["rank"]),
                dtype=str(data["dtype"]),
                architecture=str(data["architecture"]),
                dims=data.get("dims"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ConvertError(f"unreadable trainer record ({type(err).__name__}: {err})") from err


def dims_of(spec: ModelDims) -> dict[str, Any]:
    """The model's dimensions as plain JSON data (sets sorted), comparable across the two sides."""
    return json.loads(json.dumps(asdict(spec), default=sorted))


def dims_differences(trainer: dict[str, Any], engine: dict[str, Any], at: str = "") -> list[str]:
    """Every field whose value differs, as `path: trainer value != engine value`."""
    out: list[str] = []
    for key in sorted(set(trainer) | set(engine)):
        a, b = trainer.get(key), engine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += dims_differences(a, b, f"{at}{key}.")
        elif a != b:
            out.append(f"{at}{key}: trainer {a!r} != SGLang {b!r}")
    return out
