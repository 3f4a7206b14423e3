"""Rollout consistency on the trainer side: the figures (runtime/consistency.py) against hand-computed ones,
their stream contract (events.py: the `rollout` phase and its bounded, untrusted decoding), and
`Publisher.report_rollout`'s data-parallel reduction over a real gloo group of two processes."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate_devcluster.processes import free_port
from colocate_runtime import consistency
from colocate_runtime.contract import events as ev
from colocate_runtime.megatron.publisher import Publisher


def test_figures_are_the_k3_kl_and_the_log_prob_differences_of_the_kept_tokens() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
    engine = torch.tensor([[-1.0, -2.5, -0.4], [-2.0, -0.1, float("-inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the padding's -inf is masked out
    f = consistency.compare(trainer, engine, mask, threshold=0.45)
    r = [0.0, 0.5, -0.1, -1.0, 0.0]  # log-ratio = trainer - engine, kept tokens
    assert f.tokens == 5
    assert f.kl == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 5)
    assert f.diff_mean == pytest.approx(sum(abs(x) for x in r) / 5)
    assert f.diff_max == pytest.approx(1.0)
    assert f.over_fraction == pytest.approx(2 / 5)  # 0.5 and 1.0 are over 0.45
    assert consistency.compare(trainer[:1], trainer[:1]).kl == 0.0  # the same log-probs: no drift at all


def test_bad_input_gets_a_clear_error() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="differ in shape"):
        consistency.compare(a, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="mask"):
        consistency.compare(a, a, torch.ones(3))
    with pytest.raises(ValueError, match="not finite"):
        consistency.compare(a, torch.full((2, 3), float("nan")))
    with pytest.raises(ValueError, match="threshold"):
        consistency.compare(a, a, threshold=-1.0)
    empty = consistency.compare(a, a, torch.zeros(2, 3))
    assert (empty.tokens, empty.kl, empty.diff_max) == (0, 0.0, 0.0)


def test_a_rollout_record_survives_the_codec_and_stays_within_the_bounds() -> None:
    figures = consistency.compare(torch.tensor([-1.0, -2.0]), torch.tensor([-1.25, -2.0]))
    event = ev.EventSource("trainer", replica=0, rank=0, gpu="GPU-a").rollout(3, 12, figures)
    fields = ev.encode(event, now=5.0)
    assert len(fields) <= ev.ENTRY_MAX_FIELDS and fields["phase"] == "rollout"
    back = ev.decode(fields)
    assert back.rollout == figures and (back.step, back.gen, back.result) == (12, 3, "ok")
    assert "kl" not in ev.encode(ev.EventSource("trainer").event(1, 1, "finished"))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kl": "nan"}, "finite"),
        ({"kl": "-0.5"}, "kl"),
        ({"logp_over": "1.5"}, r"over_fraction"),
        ({"tokens": "-3"}, "count"),
        ({"tokens": "many"}, "malformed"),
        ({"phase": "finished"}, "figures"),  # figures on another phase
    ],
)
def test_the_decoder_refuses_bad_rollout_figures_with_an_event_error(change: dict, match: str) -> None:
    figures = ev.RolloutFigures(0.01, 0.1, 1.0, 0.02, 0.5, 100)
    fields = ev.encode(ev.EventSource("trainer").rollout(1, 2, figures), now=1.0) | change
    with pytest.raises(ev.EventError, match=match):
        ev.decode(fields)
    without = {k: v for k, v in fields.items() if k not in ev.ROLLOUT_FIELDS} | {"phase": "rollout"}
    with pytest.raises(ev.EventError, match="figures"):
        ev.decode(without)  # a rollout record without its figures


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer, engine = _shares()[rank]
        # No megatron-core here: the group is the whole world; no writer, so nothing is recorded.
        figures = Publisher.report_rollout(SimpleNamespace(writer=None), 7, trainer, engine)  # type: ignore[arg-type]
        out[rank] = figures
    finally:
        dist.destroy_process_group()


def _shares() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(2, 5, 6, generator=g) * 4
    engine = trainer + torch.randn(2, 5, 6, generator=g) * 0.2
    return [(trainer[0], engine[0]), (trainer[1], engine[1])]


def test_report_rollout_reduces_over_the_data_parallel_group() -> None:
    """Two ranks with their own tokens get the figures of all of them (sums and the max over the group)."""
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), out), nprocs=2, start_method="fork", join=True)
    trainer = torch.stack([t for t, _ in _shares()])
    engine = torch.stack([e for _, e in _shares()])
    whole = consistency.compare(trainer, engine)
    for rank in (0, 1):
        got = out[rank]
        assert got.tokens == 60
        assert got.kl == pytest.approx(whole.kl) and got.diff_max == pytest.approx(whole.diff_max)
        assert got.diff_mean == pytest.approx(whole.diff_mean)


def test_the_documented_call_is_an_excerpt_of_the_example_that_runs_and_the_yaml_the_crds_defaults() -> None:
    """docs/rollout-consistency.md: its trainer snippet is verbatim examples/megatron/train.py (which
    tests/test_demo_megatron.py runs), its spec block the CRD's defaults."""
    import yaml

    from colocate_operator.spec import RolloutConsistencySpec
    from tests.test_doc_snippets import ROOT, TRAINER, blocks, is_excerpt

    doc = ROOT / "docs" / "rollout-consistency.md"
    (snippet,) = [s for s in blocks(doc, "python") if "report_rollout" in s]
    assert is_excerpt(snippet, TRAINER.read_text())
    (spec,) = [yaml.safe_load(s) for s in blocks(doc, "yaml")]
    documented = spec["spec"]["weightSync"]["rolloutConsistency"]
    assert documented == RolloutConsistencySpec().model_dump(by_alias=True)
