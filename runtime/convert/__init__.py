"""Megatron-core <-> canonical <-> SGLang weight conversion with exact shard boxes.

Trainer rank: `trainer_plan(spec, MegatronLayout, MegatronRank)` states the canonical boxes it holds;
`.convert(chunk_state_dicts)` yields `(TensorShard, tensor)` pieces. Inference rank:
`inference_plan(spec, SGLangLayout, tp_rank)` states the boxes it needs; `.write(params, piece, data)` puts a
received piece into SGLang's fused parameters. `model_spec(hf_config)` reads a model; architectures are
registered by name (`architectures()`).
"""

from colocate_runtime.convert.architecture import Architecture, Block
from colocate_runtime.convert.errors import (
    ConvertError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    UnsupportedLayoutError,
)
from colocate_runtime.convert.inference import InferenceRankPlan, inference_plan
from colocate_runtime.convert.layout import (
    Group,
    MegatronLayout,
    MegatronRank,
    PipelineLayout,
    RankGroups,
    Role,
    SGLangLayout,
)
from colocate_runtime.convert.params import CanonicalTensor, MegatronParam, Piece, Placement, SGLangParam
from colocate_runtime.convert.qkv import fuse_query_groups, split_query_groups
from colocate_runtime.convert.registry import (
    architecture,
    architecture_for_hf,
    architectures,
    canonical_tensors,
    model_spec,
    register,
)
from colocate_runtime.convert.spec import MLASpec, ModelDims, MoESpec
from colocate_runtime.convert.trainer import (
    BoundPiece,
    ModelChunkPlan,
    TrainerRankPlan,
    convert_trainer_rank,
    trainer_plan,
)

__all__ = [
    "Architecture",
    "Block",
    "BoundPiece",
    "CanonicalTensor",
    "ConvertError",
    "Group",
    "InferenceRankPlan",
    "MLASpec",
    "MegatronLayout",
    "MegatronParam",
    "MegatronRank",
    "MissingTensorError",
    "MoESpec",
    "ModelChunkPlan",
    "ModelDims",
    "Piece",
    "PipelineLayout",
    "Placement",
    "RankGroups",
    "Role",
    "SGLangLayout",
    "SGLangParam",
    "ShapeMismatchError",
    "TrainerRankPlan",
    "UnexpectedTensorError",
    "UnknownArchitectureError",
    "UnsupportedLayoutError",
    "architecture",
    "architecture_for_hf",
    "architectures",
    "canonical_tensors",
    "convert_trainer_rank",
    "fuse_query_groups",
    "inference_plan",
    "model_spec",
    "register",
    "split_query_groups",
    "trainer_plan",
]
