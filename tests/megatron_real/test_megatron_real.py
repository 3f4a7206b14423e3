"""Real megatron-core GPTModels (pinned releases from PyPI, scripts/megatron-env.sh) converted by our
trainer-side converters, checked against Megatron's own forward.

Per release, two gloo ranks (tests/megatron_real/worker.py) build each case of cases.py on CPU with
Megatron's local layer specs and save every rank's state dict and Megatron's logits. Here, with no Megatron
imported: every rank's tensors go through `trainer_plan(...).convert` (which refuses a tensor no rule takes
and a missing or misshapen one), the pieces are assembled with every element of every canonical tensor
covered (replicas must agree), written as a Hugging Face checkpoint and loaded by transformers with no key
missing or left over, and its logits must equal Megatron's within atol = rtol = 1e-4 (fp32 on CPU; the two
differ only in the order of sums, measured at most 3e-6 on logits of magnitude about 4). The
Transformer-Engine spec's names are covered by renaming the same real state dicts per the release's own TE
spec (te_names.py), since Transformer-Engine cannot be built here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from colocate_devcluster.processes import free_port
from colocate_runtime.bits import bits
from colocate_runtime.colocated.gather import compile_gather
from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.convert import (
    MegatronLayout,
    MegatronRank,
    MissingTensorError,
    SGLangLayout,
    ShapeMismatchError,
    canonical_tensors,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.convert.published import TrainerRecord
from tests.megatron_real.cases import CASES, DIVISOR, RELEASES, VOCAB, WORLD_SIZE, Case
from tests.megatron_real.te_names import mla_down_split, to_te_names
from tests.runtime.canonical_pieces import assemble, deliver_local, flat_bytes, sglang_arena

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def megatron_path(release: str) -> str:
    """The import path holding megatron-core `release` (built once, cached)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "megatron-env.sh"), release],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.stdout.strip().splitlines()[-1]


def run_workers(release: str, out: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": megatron_path(release),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(WORLD_SIZE),
        "PYTHONWARNINGS": "ignore",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = [sys.executable, "-m", "tests.megatron_real.worker", str(out)]
    logs = [out / f"worker{rank}.log" for rank in range(WORLD_SIZE)]
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as sink:
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(rank)}, stdout=sink, stderr=sink)
            )
    try:
        codes = [proc.wait(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    if any(codes):
        tail = "\n".join(log.read_text()[-3000:] for log in logs)
        raise AssertionError(f"megatron-core {release} workers exited {codes}:\n{tail}")


@pytest.fixture(scope="module", params=RELEASES)
def release_dumps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"megatron-{request.param}")
    run_workers(request.param, out)
    return out


def load(dumps: Path, case: Case) -> list[dict]:
    return [torch.load(dumps / case.name / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def layout(case: Case, *, mla_down_split: bool = True) -> MegatronLayout:
    return MegatronLayout(
        tp=case.tp, ep=case.ep, etp=case.etp, vocab_divisor=DIVISOR, mla_down_split=mla_down_split
    )


def convert_all(
    case: Case, ranks: Sequence[Mapping], states: Sequence[Mapping[str, torch.Tensor]], lay: MegatronLayout
) -> dict[str, torch.Tensor]:
    """Every rank converted (each of its tensors consumed), then assembled (every canonical element
    produced)."""
    spec = model_spec(case.hf)
    pieces = []
    for record, state in zip(ranks, states, strict=True):
        rank = MegatronRank(**record["coords"])
        pieces += trainer_plan(spec, lay, rank).convert(state)
    return assemble(pieces, canonical_tensors(spec))


def hf_logits(case: Case, weights: Mapping[str, torch.Tensor], ids: torch.Tensor, tmp: Path) -> torch.Tensor:
    """transformers' model loaded from the canonical tensors written as a Hugging Face checkpoint (the
    canonical form is the checkpoint's; transformers fuses its experts on load), all keys used."""
    config = transformers.AutoConfig.for_model(**case.hf)
    config.save_pretrained(tmp)
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def check_logits(
    case: Case, ranks: Sequence[Mapping], weights: Mapping[str, torch.Tensor], tmp: Path
) -> None:
    ids = ranks[0]["ids"]
    expected = ranks[0]["logits"][..., :VOCAB]
    for record in ranks[1:]:
        assert torch.equal(record["ids"], ids)
    got = hf_logits(case, weights, ids, tmp)
    diff = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, **TOLERANCE), f"{case.name}: max |logit difference| {diff:.3g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_local_spec_ranks_convert_to_megatrons_model(release_dumps: Path, case: Case, tmp_path: Path) -> None:
    ranks = load(release_dumps, case)
    weights = convert_all(case, ranks, [r["state"] for r in ranks], layout(case))
    check_logits(case, ranks, weights, tmp_path)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_transformer_engine_names_convert_to_megatrons_model(
    release_dumps: Path, case: Case, tmp_path: Path
) -> None:
    """The same real weights under the names the release's Transformer-Engine spec gives them."""
    ranks = load(release_dumps, case)
    te = ranks[0]["te_spec"]
    states = to_te_names([r["state"] for r in ranks], [r["coords"]["tp_rank"] for r in ranks], te)
    names = {name for state in states for name in state}
    local = {name for record in ranks for name in record["state"]}
    if "dense.self_attention.linear_qkv" in te:  # GQA: the input norm fused into linear_qkv
        assert any(name.endswith("linear_qkv.layer_norm_weight") for name in names), sorted(names)
    if any(n.endswith(".mlp.linear_fc1.weight") for n in local):  # a dense layer: its norm fused into fc1
        assert any(name.endswith("mlp.linear_fc1.layer_norm_weight") for name in names), sorted(names)
    if "moe.mlp.experts" in te:
        assert te["moe.mlp.experts"] == "TEGroupedMLP"
        assert any(name.endswith("experts.linear_fc1.weight0") for name in names), sorted(names)
        assert not any("local_experts" in name for name in names), sorted(names)
    if "dense.self_attention.linear_q_up_proj" in te:  # MLA: q/kv norms fused into the up projections
        assert any(name.endswith("linear_kv_up_proj.layer_norm_weight") for name in names), sorted(names)
    split = "dense.self_attention.linear_q_down_proj" not in te or mla_down_split(te)
    weights = convert_all(case, ranks, states, layout(case, mla_down_split=split))
    check_logits(case, ranks, weights, tmp_path)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.tp > 1 and "q_lora_rank" in c.hf], ids=lambda c: c.name
)
def test_split_mla_down_projection_refused_when_layout_says_duplicated(
    release_dumps: Path, case: Case
) -> None:
    ranks = load(release_dumps, case)
    state = ranks[0]["state"]
    held = next(name for name in state if name.endswith("linear_kv_down_proj.weight"))
    rank = MegatronRank(**ranks[0]["coords"])
    shown = re.escape(str(tuple(state[held].shape)))
    with pytest.raises(ShapeMismatchError, match=rf"{re.escape(held)}: expected local shape .* got {shown}"):
        trainer_plan(model_spec(case.hf), layout(case, mla_down_split=False), rank).convert(state)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_publisher_reads_each_rank_s_layout_from_megatron_itself(release_dumps: Path, case: Case) -> None:
    """colocate_runtime.megatron reads parallel_state and the live model: its layout converts every rank as
    the case's known layout does (MLA down projections: split, as Megatron's local spec builds them)."""
    ranks = load(release_dumps, case)
    records = [TrainerRecord.from_json(r["facade"]) for r in ranks]
    for record, r in zip(records, ranks, strict=True):
        assert record.rank == MegatronRank(**r["coords"])
        assert (record.layout.tp, record.layout.ep, record.layout.expert_tp) == (
            case.tp,
            case.ep,
            case.etp or case.tp,
        )
        assert record.layout.mla_down_split == ("kv_lora_rank" in case.hf and case.tp > 1)
        assert record.layout.pipeline is None
    states = [r["state"] for r in ranks]
    expected = convert_all(case, ranks, states, layout(case, mla_down_split=case.tp > 1))
    got = convert_all(case, ranks, states, records[0].layout)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_legacy_grouped_mlp_refused_naming_what_the_rank_holds(release_dumps: Path) -> None:
    case = next(c for c in CASES if c.legacy_grouped)
    record = load(release_dumps, case)[1]
    state = record["legacy_state"]
    held = next(name for name in state if name.endswith("mlp.experts.weight1"))
    plan = trainer_plan(model_spec(case.hf), layout(case), MegatronRank(**record["coords"]))
    shown = re.escape(f"{held} {tuple(state[held].shape)}")
    with pytest.raises(MissingTensorError, match=f"holds instead: .*{shown}"):
        plan.convert(state)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ddp_buffers_are_read_in_place_into_sglangs_parameters_bit_for_bit(
    release_dumps: Path, case: Case
) -> None:
    """Megatron-core's own DDP (distributed optimizer) keeps each rank's parameters as views of contiguous
    buffers. The one-pass update publishes those storages as they are, packing nothing, and the reader's
    gather program writes SGLang's fused parameters (SGLang TP 2, rank r on trainer rank r's GPU) equal, bit
    for bit, to the converter's reference output cut to what that GPU holds."""
    spec = model_spec(case.hf)
    for r, record in enumerate(load(release_dumps, case)):
        state = record["ddp_state"]
        plan = trainer_plan(spec, layout(case), MegatronRank(**record["coords"]))
        storages = {t.untyped_storage().data_ptr() for t in state.values()}
        in_place = InPlaceLayout.compile(
            plan.bind(state), adoptable=lambda t: True, bucket_bytes=1 << 20, min_adopt_bytes=0
        )
        assert not in_place.packed and all(e.view is not None for e in in_place.entries)
        assert record["ddp_buffers"] >= 1 and len(in_place.adopted) <= len(storages)
        iplan = inference_plan(spec, SGLangLayout(tp=WORLD_SIZE), r)
        reference = deliver_local(iplan, plan.convert(record["state"]))
        _, fused = sglang_arena(iplan)
        read = iplan.read(fused)
        targets = {s.name: v for s, v in read if s.name in reference}
        program = compile_gather(in_place.entries, targets, {s.name: s for s, _ in read}, None)
        memory = [flat_bytes(base) for base in in_place.adopted]
        program.copy_slow(memory.__getitem__)
        for name, (where, want) in reference.items():
            assert torch.equal(bits(targets[name][where]), bits(want)), f"{case.name} rank {r}: {name}"
