"""The pure parts of the SGLang loader's automatic wiring (runtime/sglang/auto.py): SGLang's server arguments
to a layout, the covered / not-covered decision on two layouts, and the errors a user sees. No processes, no
Redis: a dict stands in for the meta-store's trainer records."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from colocate_runtime.colocated.config import ColocateConfig, MetaStoreAddress
from colocate_runtime.convert import (
    MegatronLayout,
    MegatronRank,
    SGLangLayout,
    UnsupportedLayoutError,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.convert.published import TrainerRecord, dims_of
from colocate_runtime.p2p.layout import Layout
from colocate_runtime.sglang import auto
from colocate_runtime.sglang.auto import AutoWiringError, EngineArgs, Worker

QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
QWEN3_MOE.update(moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


# --- server arguments -> SGLangLayout -----------------------------------------------------------------------


def test_server_args_of_0_5_10_give_the_layout() -> None:
    """0.5.10's ServerArgs: DP attention is --enable-dp-attention with its size in dp_size."""
    args = SimpleNamespace(
        tp_size=8, pp_size=1, ep_size=4, dp_size=2, enable_dp_attention=True, enable_dp_lm_head=True
    )
    args.moe_dense_tp_size = 2
    layout = auto.engine_args_from_server_args(args).layout()
    assert layout == SGLangLayout(tp=8, ep=4, dp_attention=2, dp_lm_head=True, moe_dense_tp=2)
    plain = SimpleNamespace(tp_size=4, dp_size=3, enable_dp_attention=False)  # dp replicas, not attention DP
    assert auto.engine_args_from_server_args(plain).layout() == SGLangLayout(tp=4)


def test_the_resolved_parallel_namespace_of_0_5_23_gives_the_layout() -> None:
    parallel = SimpleNamespace(tp_size=4, pp_size=1, ep_size=2, attn_dp_size=2, attn_cp_size=1, moe_dp_size=1)
    parallel.enable_dp_lm_head, parallel.moe_dense_tp_size, parallel.dp_size = False, None, 1
    assert auto.engine_args_from_parallel(parallel).layout() == SGLangLayout(tp=4, ep=2, dp_attention=2)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (EngineArgs(tp=2, pp=2), "--pp-size 2"),
        (EngineArgs(tp=4, attn_cp=2), "attention context parallelism 2"),
        (EngineArgs(tp=4, moe_dp=2), "--moe-dp-size 2"),
        (EngineArgs(tp=4, ep=3), "ep size 3 does not divide tp 4"),
    ],
)
def test_layouts_the_converters_cannot_place_are_refused_by_name(args: EngineArgs, says: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=says):
        args.layout()


def test_outside_sglang_the_engine_is_plain_tp_of_the_group() -> None:
    assert auto.read_engine_args(3) == EngineArgs(tp=3)


# --- the covered / not-covered decision ---------------------------------------------------------------------


def layouts(
    model: dict[str, Any], megatron: MegatronLayout, ranks: list[MegatronRank], sglang: SGLangLayout
) -> tuple[Layout, Layout]:
    """Trainer rank `ranks[r]` publishes on GPU r; SGLang worker r reads there."""
    spec = model_spec(model)
    trainer = Layout.from_ranks(trainer_plan(spec, megatron, m).rank_shards(r) for r, m in enumerate(ranks))
    inference = Layout.from_ranks(inference_plan(spec, sglang, r).rank_shards(r) for r in sglang.ranks())
    return trainer, inference


TP2 = [MegatronRank(tp_rank=0), MegatronRank(tp_rank=1)]


def test_equal_shards_and_a_trainer_holding_more_are_covered() -> None:
    assert auto.uncovered(*layouts(QWEN3, MegatronLayout(tp=2), TP2, SGLangLayout(tp=2))) == []
    dp = [MegatronRank(), MegatronRank()]  # two data-parallel TP1 ranks: the whole model on each GPU
    assert auto.uncovered(*layouts(QWEN3, MegatronLayout(tp=1), dp, SGLangLayout(tp=2))) == []
    moe = [MegatronRank(tp_rank=r, ep_rank=r) for r in range(2)]  # TP2 EP2 (expert TP 1) <-> SGLang TP2 EP2
    assert (
        auto.uncovered(*layouts(QWEN3_MOE, MegatronLayout(tp=2, ep=2, etp=1), moe, SGLangLayout(2, 2))) == []
    )


def test_vocab_padding_that_differs_is_not_covered_and_says_where() -> None:
    """Megatron pads 300 rows to 512 (256 per rank), SGLang to 320 (160 per rank)."""
    missing = auto.uncovered(
        *layouts({**QWEN3, "vocab_size": 300}, MegatronLayout(tp=2), TP2, SGLangLayout(tp=2))
    )
    assert len(missing) == 2 and all(m.startswith("worker 1 needs ") for m in missing), missing
    embed = "model.embed_tokens.weight[160:300, 0:64]; the trainer rank on its GPU holds [256:300, 0:64]"
    assert any(embed in m for m in missing), missing


def test_a_trainer_with_less_or_other_experts_is_not_covered() -> None:
    half = [MegatronRank(tp_rank=0), MegatronRank(tp_rank=0)]  # both GPUs hold TP rank 0 of a TP2 trainer
    missing = auto.uncovered(*layouts(QWEN3, MegatronLayout(tp=2), half, SGLangLayout(tp=1)))
    assert missing and all(m.startswith("worker 0 needs ") for m in missing)
    swapped = [MegatronRank(tp_rank=r, ep_rank=1 - r) for r in range(2)]
    missing = auto.uncovered(
        *layouts(QWEN3_MOE, MegatronLayout(tp=2, ep=2, etp=1), swapped, SGLangLayout(tp=2, ep=2))
    )
    assert any("experts" in m for m in missing), missing


def test_a_dtype_that_differs_is_an_error_not_an_exchange() -> None:
    trainer, inference = layouts(QWEN3, MegatronLayout(tp=2), TP2, SGLangLayout(tp=2))
    spec = model_spec(QWEN3, dtype="float32")
    inference = Layout.from_ranks(
        inference_plan(spec, SGLangLayout(tp=2), r).rank_shards(r) for r in range(2)
    )
    with pytest.raises(AutoWiringError, match=r"the trainer publishes bfloat16 .* SGLang needs float32"):
        auto.uncovered(trainer, inference)


# --- the plans and their errors -----------------------------------------------------------------------------


def record(model: dict[str, Any] = QWEN3, **layout: Any) -> TrainerRecord:
    spec = model_spec(model)
    return TrainerRecord(MegatronLayout(**layout), MegatronRank(), spec.dtype, spec.architecture)


def test_another_architecture_is_refused_naming_both() -> None:
    with pytest.raises(AutoWiringError, match="publishes a 'qwen3_moe' model, SGLang serves 'qwen3'"):
        auto.rank_plans(record(QWEN3_MOE), QWEN3, EngineArgs(tp=1), 0)


def test_a_model_config_other_than_the_trainers_is_refused_naming_the_field() -> None:
    """SGLang's CPU path pads an expert intermediate size that does not split over TP (32 at TP 2 -> 64): its
    config then differs from the trainer's, and the update says so instead of planning with either."""
    trainer = dims_of(model_spec(QWEN3_MOE))
    sglang = {**QWEN3_MOE, "moe_intermediate_size": 2 * QWEN3_MOE["moe_intermediate_size"]}
    rec = replace(record(QWEN3_MOE), dims=trainer)
    with pytest.raises(AutoWiringError, match=r"moe\.intermediate_size: trainer 32 != SGLang 64"):
        auto.rank_plans(rec, sglang, EngineArgs(tp=2), 0)
    assert auto.rank_plans(rec, QWEN3_MOE, EngineArgs(tp=2), 0).trainer.spec == model_spec(QWEN3_MOE)


class FakeModel(torch.nn.Module):
    def __init__(self, params: dict[str, torch.Tensor], config: Any = QWEN3) -> None:
        super().__init__()
        self._params = params
        if config is not None:
            self.config = config

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def, override]
        return iter(self._params.items())


def sglang_model(tp: int = 1, rank: int = 0, model: dict[str, Any] = QWEN3) -> FakeModel:
    plan = inference_plan(model_spec(model), SGLangLayout(tp=tp), rank)
    return FakeModel({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in plan.param_shapes().items()}, model)


class Records:
    """The meta-store's trainer records, by GPU UUID."""

    def __init__(self, **records: TrainerRecord) -> None:
        self.records = {uuid: r.to_json() for uuid, r in records.items()}

    def read_trainer_record(self, uuid: str) -> bytes | None:
        text = self.records.get(uuid)
        return None if text is None else text.encode()


CFG = ColocateConfig(job="rl-job", namespace="team-a", metastore=MetaStoreAddress("h", 1, "p"))
CFG_QUICK = ColocateConfig(
    job="rl-job", namespace="team-a", metastore=MetaStoreAddress("h", 1, "p"), step_timeout_s=0.2
)


def wire(
    model: FakeModel, store: Records, cfg: ColocateConfig = CFG, **engine: Any
) -> auto.AutoWiring | None:
    engine_args = EngineArgs(**{"tp": 1, **engine})
    return auto.automatic_wiring(model, cfg, store, Worker(0, None, None, "GPU-0"), engine_args)  # type: ignore[arg-type]


def test_no_record_anywhere_keeps_the_default_loader() -> None:
    assert wire(sglang_model(), Records(**{"GPU-other": record()})) is None


def test_a_single_worker_with_a_record_reads_locally_into_views_of_its_parameters() -> None:
    model = sglang_model()
    wired = wire(model, Records(**{"GPU-0": record()}))
    assert wired is not None and wired.path == "local" and wired.exchange is None
    qkv = model._params["model.layers.0.self_attn.qkv_proj.weight"]
    q = wired.targets["model.layers.0.self_attn.q_proj.weight"]
    assert q.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # a view, not a copy
    assert wired.target_shards["model.layers.0.self_attn.q_proj.weight"].box.lengths == tuple(q.shape)


def test_a_model_that_is_not_the_plan_says_which_parameter() -> None:
    model = sglang_model()
    model._params["model.norm.weight"] = torch.zeros(63, dtype=torch.bfloat16)
    with pytest.raises(AutoWiringError, match=r"worker 0: ShapeMismatchError: model.norm.weight"):
        wire(model, Records(**{"GPU-0": record()}))


def test_a_model_without_config_and_an_engine_of_another_size_are_explained() -> None:
    with pytest.raises(AutoWiringError, match="has no `config`"):
        wire(FakeModel(dict(sglang_model().named_parameters()), config=None), Records(**{"GPU-0": record()}))
    with pytest.raises(AutoWiringError, match="SGLang's arguments say TP 2, this worker's TP group has 1"):
        wire(sglang_model(), Records(**{"GPU-0": record()}), tp=2)


def test_targets_from_other_gpus_without_a_group_are_refused() -> None:
    """A TP2 trainer rank on this GPU holds half; a lone TP1 worker cannot get the rest without a group."""
    with pytest.raises(AutoWiringError, match="needs SGLang's TP group"):
        wire(sglang_model(), Records(**{"GPU-0": record(tp=2)}))


def test_a_missing_record_names_the_key_and_what_writes_it() -> None:
    with pytest.raises(AutoWiringError) as err:
        auto.wait_for_record(Records(), CFG_QUICK, "GPU-0", 0.2)  # type: ignore[arg-type]
    text = str(err.value)
    assert "colocate:team-a:rl-job:trainer:GPU-0" in text and "colocate_runtime.megatron" in text


# --- the loader's choice between user resolvers, the automatic wiring and SGLang's own names ---------------


class BuiltReader(SimpleNamespace):
    """What `new_reader` was called with (the loader's reader, without a meta-store)."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[BuiltReader]:
    from colocate_runtime.colocated.reader import ReaderSettings
    from colocate_runtime.sglang import loader

    calls: list[BuiltReader] = []

    def new_reader(cfg: ColocateConfig, targets: Any, **kw: Any) -> BuiltReader:
        calls.append(BuiltReader(targets=targets, settings=ReaderSettings(job="j", namespace="n"), **kw))
        return calls[-1]

    shm = ColocateConfig(
        job="j", namespace="n", metastore=MetaStoreAddress("h", 1, "p"), transport="SharedMemory"
    )
    monkeypatch.setattr(loader, "new_reader", new_reader)
    monkeypatch.setattr(loader, "_cfg", lambda: shm)
    monkeypatch.setattr(loader, "register_engine", lambda rank=None: None)
    monkeypatch.setattr(loader, "_readers", {})
    monkeypatch.setattr(loader, "_resolver", None)
    monkeypatch.setattr(loader, "_exchange_resolver", None)
    return calls


def test_the_loader_prefers_user_resolvers_then_the_records_then_sglangs_names(
    built: list[BuiltReader], monkeypatch: pytest.MonkeyPatch
) -> None:
    from colocate_runtime.sglang import loader

    model = sglang_model()
    auto_calls: list[int] = []
    wired = auto.AutoWiring({"x": torch.zeros(1)}, {}, None, "local", "test")
    monkeypatch.setattr(loader, "_automatic", lambda *a: auto_calls.append(1) or wired)
    loader.reader_for(model)
    assert built[-1].targets is wired.targets and built[-1].settings.allow_extra_entries  # the records
    loader._readers.clear()
    monkeypatch.setattr(loader, "_automatic", lambda *a: auto_calls.append(1) or None)
    loader.reader_for(model)
    assert built[-1].targets.keys() == dict(model.named_parameters()).keys()  # no record: SGLang's names
    assert not built[-1].settings.allow_extra_entries
    loader._readers.clear()
    mine = {"y": torch.zeros(1)}
    loader.set_target_resolver(lambda _model: mine)
    loader.reader_for(model)
    assert built[-1].targets is mine and len(auto_calls) == 2  # the user's resolver: no automatic wiring


def test_a_wiring_that_fails_becomes_a_reader_that_fails_the_step_with_why(
    built: list[BuiltReader], monkeypatch: pytest.MonkeyPatch
) -> None:
    from colocate_runtime.colocated.outcome import StepFailed
    from colocate_runtime.sglang import loader

    def fails(*args: Any) -> None:
        raise AutoWiringError("automatic colocated wiring failed on worker 1: no trainer record")

    monkeypatch.setattr(loader, "_automatic", fails)
    loader.reader_for(sglang_model())
    refusal = built[-1].exchange
    assert built[-1].targets == {} and isinstance(refusal, loader._Refusal)
    request = SimpleNamespace(manifest=SimpleNamespace(step=4))
    with pytest.raises(StepFailed, match="failed on worker 1: no trainer record") as err:
        refusal(request)
    assert err.value.step == 4


# --- an engine serving block FP8 ----------------------------------------------------------------------------

# Every fused part whole 128-row blocks (SGLang refuses block-FP8 layouts that cut a block)
QWEN3_BLOCKS = {**QWEN3, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4}
QWEN3_BLOCKS.update(head_dim=32, intermediate_size=256)
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def fp8_model(model: dict[str, Any] = QWEN3_BLOCKS) -> FakeModel:
    from colocate_runtime.convert.fp8 import fp8_layout, fp8_quantization
    from colocate_runtime.dtypes import torch_dtype

    config = {**model, "quantization_config": FP8_CONFIG}
    plan = inference_plan(model_spec(model), SGLangLayout(tp=1), 0)
    quant = fp8_quantization(config)
    assert quant is not None
    held = fp8_layout(plan, quant).values()
    return FakeModel({h.name: torch.zeros(h.shape, dtype=torch_dtype(h.dtype)) for h in held}, config)


def test_a_block_fp8_engine_gets_e4m3_targets_with_the_scale_rows_of_their_blocks() -> None:
    model = fp8_model()
    wired = wire(model, Records(**{"GPU-0": record(QWEN3_BLOCKS)}))
    assert wired is not None and wired.fp8_format is not None and not wired.fp8_format.ue8m0
    layer = "model.layers.0.self_attn"
    qkv_scale = model._params[f"{layer}.qkv_proj.weight_scale_inv"]  # rows: q 256, k 128, v 128 -> 4 blocks
    assert qkv_scale.shape == (4, 2)
    for part, rows in (("q", (0, 2)), ("k", (2, 3)), ("v", (3, 4))):
        target = wired.targets[f"{layer}.{part}_proj.weight"]
        scale = wired.scales[f"{layer}.{part}_proj.weight"]
        assert target.dtype == torch.float8_e4m3fn
        assert (
            scale.data_ptr() == qkv_scale[rows[0] : rows[1]].data_ptr()
            and scale.shape[0] == rows[1] - rows[0]
        )
    assert "model.norm.weight" in wired.targets and "model.norm.weight" not in wired.scales  # BF16 stays


def test_a_declared_weight_format_the_engine_contradicts_is_refused_naming_both() -> None:
    store = Records(**{"GPU-0": record(QWEN3_BLOCKS)})
    with pytest.raises(AutoWiringError, match=r"rolloutWeights=BF16, SGLang's model config says block FP8"):
        wire(fp8_model(), store, replace(CFG, rollout_weights="BF16"))
    bf16 = FakeModel(
        {
            n: torch.zeros(s, dtype=torch.bfloat16)
            for n, s in inference_plan(model_spec(QWEN3_BLOCKS), SGLangLayout(tp=1), 0).param_shapes().items()
        },
        QWEN3_BLOCKS,
    )
    with pytest.raises(
        AutoWiringError, match=r"rolloutWeights=BlockFP8, SGLang's model config says the model dtype"
    ):
        wire(bf16, store, replace(CFG, rollout_weights="BlockFP8"))
    assert wire(fp8_model(), store, replace(CFG, rollout_weights="BlockFP8")) is not None
