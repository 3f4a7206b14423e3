"""Parallel layouts of the two sides, and the groups each role of a weight is sharded over.

A rule never asks "am I on Megatron or SGLang?" to compute a box: it asks for the `Group` of its role
(attention, dense MLP, experts, vocabulary). Both sides resolve roles to groups here, so a renamed tensor can
never lose its sharding semantics (the seed's `embed_tokens` bug) and both sides compute boxes identically.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from itertools import product

from colocate_runtime.convert.errors import UnsupportedLayoutError
from colocate_runtime.convert.spec import ModelDims


@dataclass(frozen=True, slots=True)
class Group:
    """One rank's view of one parallel group: its size and the rank's index in it."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise UnsupportedLayoutError(f"rank {self.rank} is not in a group of size {self.size}")


SOLO = Group(1, 0)


class Role(Enum):
    """What decides a weight's sharding group."""

    REPLICATED = "replicated"
    ATTENTION = "attention"
    MLP = "mlp"  # dense MLP layers and shared experts
    MLA_DOWN = "mla_down"  # MLA q/kv down projections: TP-split or duplicated, as the trainer's spec has it


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class RankGroups:
    """Everything a rule needs to know about one rank's place in its side's layout."""

    attention: Group
    mlp: Group
    expert_parallel: Group
    expert_tensor: Group
    embedding: Group
    embedding_rows: int  # padded vocabulary rows of the input embedding (real rows come first)
    lm_head: Group
    lm_head_rows: int
    kv_replication: bool  # may the attention group be larger than the KV head count (SGLang replicates)
    mla_down: Group = SOLO

    def of(self, role: Role) -> Group:
        if role is Role.ATTENTION:
            return self.attention
        if role is Role.MLP:
            return self.mlp
        if role is Role.MLA_DOWN:
            return self.mla_down
        return SOLO


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Decoder layers per model chunk, `layer_counts[vp_stage][pp_rank]`.

    Megatron orders chunks by virtual stage, then pipeline rank, and gives each chunk the next consecutive
    global layer ids; local names restart at 0 in every chunk. Empty chunks are allowed.
    """

    layer_counts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.layer_counts or not self.layer_counts[0]:
            raise UnsupportedLayoutError("a pipeline layout needs at least one stage")
        if len({len(row) for row in self.layer_counts}) != 1:
            raise UnsupportedLayoutError(f"every virtual stage needs one count per pipeline rank: {self}")
        if any(n < 0 for row in self.layer_counts for n in row):
            raise UnsupportedLayoutError(f"negative layer count in {self.layer_counts}")

    @property
    def pp(self) -> int:
        return len(self.layer_counts[0])

    @property
    def vpp(self) -> int:
        return len(self.layer_counts)

    @property
    def num_layers(self) -> int:
        return sum(sum(row) for row in self.layer_counts)

    @staticmethod
    def even(num_layers: int, pp: int = 1, vpp: int = 1) -> PipelineLayout:
        chunks = pp * vpp
        if num_layers % chunks:
            raise UnsupportedLayoutError(
                f"{num_layers} layers do not split evenly over {pp} pipeline x {vpp} virtual stages"
            )
        return PipelineLayout(tuple((num_layers // chunks,) * pp for _ in range(vpp)))

    @staticmethod
    def uneven(
        num_layers: int, pp: int, first: int | None = None, last: int | None = None, vpp: int = 1
    ) -> PipelineLayout:
        """Megatron's `decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers`: the first and
        last pipeline ranks hold the given counts, the middle ranks share the rest evenly; with a virtual
        pipeline every count is divided evenly over the virtual stages."""
        ends = (first is not None) + (last is not None)
        if ends and pp < max(ends, 2):  # Megatron rejects uneven stages without pipeline parallelism
            raise UnsupportedLayoutError(f"uneven first/last stages need more than {pp} pipeline rank(s)")
        middle_ranks = pp - ends
        middle = num_layers - (first or 0) - (last or 0)

        def per_chunk(count: int, ranks: int) -> int:
            if ranks == 0:
                if count:
                    raise UnsupportedLayoutError(f"{count} layers left over with no middle pipeline rank")
                return 0
            if count < 0 or count % (ranks * vpp):
                raise UnsupportedLayoutError(
                    f"{count} layers do not split evenly over {ranks} pipeline rank(s) x {vpp} virtual stages"
                )
            return count // (ranks * vpp)

        row = [per_chunk(middle, middle_ranks)] * pp
        if first is not None:
            row[0] = per_chunk(first, 1)
        if last is not None:
            row[-1] = per_chunk(last, 1)
        return PipelineLayout(tuple(tuple(row) for _ in range(vpp)))

    def layers(self, pp_rank: int, vp_stage: int) -> range:
        """Global ids of the layers of one model chunk, in local order."""
        start = 0
        for vp, row in enumerate(self.layer_counts):
            for pp, count in enumerate(row):
                if (vp, pp) == (vp_stage, pp_rank):
                    return range(start, start + count)
                start += count
        raise UnsupportedLayoutError(f"no chunk (pp_rank {pp_rank}, vp_stage {vp_stage}) in {self}")

    def is_first(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == 0 and vp_stage == 0

    def is_last(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == self.pp - 1 and vp_stage == self.vpp - 1


@dataclass(frozen=True, slots=True)
class MegatronRank:
    """A trainer rank's coordinates; data- and context-parallel replicas hold the same weights."""

    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    tp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None = tp, Megatron-core's default
    pipeline: PipelineLayout | None = None  # None: one stage holding every layer
    vocab_divisor: int = 128  # make_vocab_size_divisible_by; Megatron pads the vocab to divisor * tp
    # MLA `linear_q_down_proj` / `linear_kv_down_proj`: column-parallel over TP (rows split: Megatron's local
    # spec in every release, its Transformer-Engine spec before 0.14) or duplicated on every TP rank
    # (TELinear, the Transformer-Engine spec from 0.14).
    mla_down_split: bool = False

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def pipeline_for(self, spec: ModelDims) -> PipelineLayout:
        pipeline = self.pipeline or PipelineLayout.even(spec.num_layers)
        if pipeline.num_layers != spec.num_layers:
            raise UnsupportedLayoutError(
                f"pipeline layout holds {pipeline.num_layers} layers, the model has {spec.num_layers}"
            )
        return pipeline

    def ranks(self) -> Iterator[MegatronRank]:
        """Every distinct coordinate of one data-parallel replica (a real rank is one of them)."""
        pp = 1 if self.pipeline is None else self.pipeline.pp
        for pp_rank, tp_rank, ep_rank, etp_rank in product(
            range(pp), range(self.tp), range(self.ep), range(self.expert_tp)
        ):
            yield MegatronRank(tp_rank, pp_rank, ep_rank, etp_rank)

    def groups(self, spec: ModelDims, rank: MegatronRank) -> RankGroups:
        tp = Group(self.tp, rank.tp_rank)
        rows = round_up(spec.vocab_size, self.vocab_divisor * self.tp)
        return RankGroups(
            attention=tp,
            mlp=tp,
            expert_parallel=Group(self.ep, rank.ep_rank),
            expert_tensor=Group(self.expert_tp, rank.etp_rank),
            embedding=tp,
            embedding_rows=rows,
            lm_head=tp,
            lm_head_rows=rows,
            kv_replication=False,  # Megatron needs num_query_groups divisible by TP
            mla_down=tp if self.mla_down_split else SOLO,
        )


@dataclass(frozen=True, slots=True)
class SGLangLayout:
    """SGLang's server arguments that decide weight sharding (one engine; data-parallel engines repeat it)."""

    tp: int = 1
    ep: int = 1  # --ep-size: experts split over ep, each expert's intermediate over tp / ep
    dp_attention: int = 1  # --dp-size with --enable-dp-attention: attention TP is tp / dp_attention
    dp_lm_head: bool = False  # --enable-dp-lm-head: lm_head sharded over the attention TP group
    moe_dense_tp: int | None = None  # --moe-dense-tp-size: dense MLP TP size (None = tp)
    vocab_padding: int = 64  # VocabParallelEmbedding pads the vocab to this multiple, then splits it

    def __post_init__(self) -> None:
        for name, size in (
            ("ep", self.ep),
            ("dp_attention", self.dp_attention),
            ("moe_dense_tp", self.moe_dense_tp or 1),
        ):
            if self.tp % size:
                raise UnsupportedLayoutError(f"SGLang {name} size {size} does not divide tp {self.tp}")

    def ranks(self) -> range:
        return range(self.tp)

    def groups(self, spec: ModelDims, tp_rank: int) -> RankGroups:
        tp = Group(self.tp, tp_rank)
        attn_size = self.tp // self.dp_attention
        attention = Group(attn_size, tp_rank % attn_size)
        moe_tp = self.tp // self.ep
        dense = self.moe_dense_tp or self.tp
        rows = round_up(spec.vocab_size, self.vocab_padding)
        # Under DP attention each attention-DP rank embeds its own tokens, so the embedding is replicated.
        embedding = SOLO if self.dp_attention > 1 else tp
        return RankGroups(
            attention=attention,
            mlp=Group(dense, tp_rank % dense),
            expert_parallel=Group(self.ep, tp_rank // moe_tp),
            expert_tensor=Group(moe_tp, tp_rank % moe_tp),
            embedding=embedding,
            embedding_rows=rows,
            lm_head=attention if self.dp_lm_head else tp,
            lm_head_rows=rows,
            kv_replication=True,
        )
