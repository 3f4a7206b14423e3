"""Rollout consistency in the operator's pure layer: the trainer's rollout reports folded into
status.rollout.consistency and RolloutConsistent (steps.RolloutFold), the status they write, and the action
the reconciler takes on a breach (decide.py). The Event, metrics and actions on the control plane:
test_rollout_consistency_integration.py. 1000 healthy training steps of real statistics: the slow set."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.rollout_check import RolloutNews, fold_for
from colocate_operator.spec import RolloutConsistencySpec
from colocate_operator.status import JobStatus, StatusView, step_patch
from colocate_operator.steps import RolloutFold, StepTracker, step_conditions
from colocate_runtime import consistency
from colocate_runtime.contract.events import RolloutFigures, StepEvent
from colocate_runtime.sglang.standin import TinyLM
from tests.operator import factories
from tests.operator.test_decide import cond, reasons, run, running_observed, running_status

POLICY = RolloutConsistencySpec(baseline_min_steps=3, baseline_steps=5)


def report(step: int, kl: float, *, gen: int = 1, tokens: int = 512) -> StepEvent:
    figures = RolloutFigures(kl, 10 * kl, 100 * kl, 0.0, 0.5, tokens)
    return StepEvent(
        role="trainer", gen=gen, step=step, phase="rollout", result="ok", rollout=figures, ts=1000.0 + step
    )


def fold_of(*kls: float, policy: RolloutConsistencySpec = POLICY) -> RolloutFold:
    fold = RolloutFold(policy=policy)
    for step, kl in enumerate(kls, 1):
        fold.observe(report(step, kl))
    return fold


def test_no_report_no_condition_and_no_status() -> None:
    tracker = StepTracker(expected_gpus=1)
    assert tracker.rollout.condition(3) is None and tracker.rollout.status() is None
    assert Cond.ROLLOUT_CONSISTENT not in {c.type for c in step_conditions(tracker, False, 60)}


def test_a_healthy_report_is_consistent_and_feeds_the_baseline() -> None:
    fold = fold_of(0.001, 0.002, 0.003)
    c = fold.condition(3)
    assert c is not None and (c.status, c.reason) == (True, Reason.KL_WITHIN_BOUNDS)
    assert "step 3: KL 0.003" in c.message and fold.baseline() == pytest.approx(0.002)
    assert fold.breaches == 0


def test_kl_over_the_threshold_breaches_with_the_step_and_the_figure_named() -> None:
    fold = fold_of(0.001, 0.05)
    c = fold.condition(2)
    assert c is not None and (c.status, c.reason) == (False, Reason.KL_OVER_THRESHOLD)
    assert c.message.startswith("step 2: KL 0.05 is over klThreshold 0.01"), c.message
    assert fold.breaches == 1 and fold.baseline() is None  # a breach never feeds the baseline


def test_kl_over_the_baseline_breaches_only_above_the_floor_and_after_enough_steps() -> None:
    # Twice a baseline of 0.002 and over the 0.001 floor: a breach.
    fold = fold_of(0.002, 0.002, 0.002, 0.005)
    c = fold.condition(4)
    assert (
        c is not None
        and c.reason == Reason.KL_OVER_BASELINE
        and "2 x the rolling baseline 0.002" in c.message
    )
    # Ten times a tiny baseline, but under the floor: noise in the last digits, no breach.
    assert fold_of(1e-6, 1e-6, 1e-6, 1e-5).breaches == 0
    # Before baselineMinSteps healthy steps there is no baseline to exceed.
    assert fold_of(0.002, 0.009).breaches == 0


def test_a_run_of_breaching_reports_is_one_breach_and_a_new_trainer_starts_another() -> None:
    fold = fold_of(0.001, 0.05, 0.06, 0.07)
    assert fold.breaches == 1
    fold.observe(report(5, 0.001))
    fold.observe(report(6, 0.05))
    assert fold.breaches == 2  # breached again after a healthy report
    fold.observe(report(1, 0.05, gen=2))  # a resumed trainer (new incarnation) from step 1
    assert fold.breaches == 3 and fold.step == 1


def test_repeated_and_older_reports_of_the_same_trainer_are_ignored() -> None:
    fold = fold_of(0.001, 0.002)
    assert fold.observe(report(2, 0.5)) is False and fold.observe(report(1, 0.5)) is False
    assert fold.breaches == 0 and fold.last is not None and fold.last.kl == 0.002


def test_the_baseline_window_stays_bounded() -> None:
    fold = fold_of(*([0.001] * 1000), policy=RolloutConsistencySpec(baseline_steps=7))
    assert fold.status() is not None and fold.status().consistency.baseline_steps == 7  # type: ignore[union-attr]


def test_the_status_shows_four_significant_digits_where_the_metrics_keep_the_full_values() -> None:
    fold = fold_of(1.0 / 3)
    part = step_patch(StepTracker(expected_gpus=1).weight_sync_status(), (), [], fold.status())
    c = part["rollout"]["consistency"]
    assert (c["kl"], c["logpDiffMean"], c["logpDiffMax"]) == (0.3333, 3.333, 33.33), c
    assert fold.last is not None and fold.last.kl == 1.0 / 3  # the fold (and the gauges) keep all digits
    shown = fold_of(2.3456789e-6).status()
    assert shown is not None and shown.model_dump(by_alias=True)["consistency"]["kl"] == 2.346e-6


def test_no_data_when_steps_go_on_without_reports() -> None:
    fold = fold_of(0.001)
    c = fold.condition(1 + 6)
    assert c is not None and (c.status, c.reason) == (False, Reason.NO_DATA)


def test_the_status_written_is_the_crds_shape_with_the_last_figures_and_the_newest_breach() -> None:
    tracker = StepTracker(expected_gpus=1, rollout=fold_of(0.001, 0.002, 0.003, 0.05))
    part = step_patch(tracker.weight_sync_status(), (), [], tracker.rollout.status())
    c = part["rollout"]["consistency"]
    assert (c["step"], c["kl"], c["tokens"], c["breaches"], c["lastBreachStep"]) == (4, 0.05, 512, 1, 4)
    assert c["baselineKL"] == pytest.approx(0.002) and c["baselineSteps"] == 3
    assert "klThreshold" in c["lastBreach"]
    assert JobStatus.of(part).rollout is not None  # the model reads back what it wrote
    assert StatusView({"rollout": part["rollout"]}).rollout_breach_since == 1004.0  # step 4's report


def test_a_restarted_follower_does_not_report_a_breach_status_shows_again() -> None:
    first = fold_of(0.001, 0.05)
    status = {"rollout": first.status().model_dump(mode="json", by_alias=True)}  # type: ignore[union-attr]
    assert status["rollout"]["consistency"]["lastBreachTime"].startswith("1970-01-01T00:16:42")
    fold = fold_for(POLICY, {"metadata": {"name": "demo"}, "status": status})
    for step, kl in enumerate((0.001, 0.05), 1):  # the stream replayed from its start
        fold.observe(report(step, kl))
    news = RolloutNews.of(fold, fold.status())
    assert news is not None and news.breach is None and news.consistent is False
    fold.observe(report(3, 0.001))
    written = fold.status()  # what a status write carried
    fold.observe(report(4, 0.2))
    assert RolloutNews.of(fold, written).breach is None  # type: ignore[union-attr]  # not in status yet
    news = RolloutNews.of(fold, fold.status())
    assert news is not None and news.breach is not None and news.breach.step == 4


# The action (decide.py) ------------------------------------------------------------------------------------


def breach_status(reason: str = Reason.KL_OVER_THRESHOLD) -> dict[str, Any]:
    message = "step 9: KL 0.05 is over klThreshold 0.01 (|delta logp| mean 0.3, max 4)"
    c = {
        "type": Cond.ROLLOUT_CONSISTENT,
        "status": str(reason == Reason.KL_WITHIN_BOUNDS),
        "reason": reason,
        "message": message,
    }
    return running_status(conditions=[c])


def test_action_fail_ends_the_job_failed_naming_the_step_and_the_kl() -> None:
    job = factories.job(weightSync={"rolloutConsistency": {"action": "Fail"}})
    plan = run(breach_status(), running_observed(), job)
    assert plan.status["phase"] == Phase.FAILED and plan.persist_first
    failed = cond(plan, Cond.FAILED)
    assert failed["reason"] == Reason.ROLLOUT_INCONSISTENT
    assert "step 9: KL 0.05" in failed["message"], failed
    assert Reason.JOB_FAILED in reasons(plan)


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        ("Report", Reason.KL_OVER_THRESHOLD),  # reported only
        ("Fail", Reason.NO_DATA),  # no report is no breach
        ("Fail", Reason.KL_WITHIN_BOUNDS),
        ("SuspendAtStepBoundary", Reason.KL_OVER_BASELINE),  # the follower sets spec.suspend, not decide
    ],
)
def test_no_other_case_stops_the_job(action: str, reason: str) -> None:
    job = factories.job(weightSync={"rolloutConsistency": {"action": action}})
    assert run(breach_status(reason), running_observed(), job).status["phase"] == Phase.RUNNING


def test_a_suspend_the_breach_asked_for_says_so_in_the_suspended_condition() -> None:
    job = factories.job(suspend=True, weightSync={"rolloutConsistency": {"action": "SuspendAtStepBoundary"}})
    plan = run(breach_status() | {"phase": Phase.SUSPENDED}, running_observed(), job)
    suspended = cond(plan, Cond.SUSPENDED)
    assert (suspended["status"], suspended["reason"]) == ("True", Reason.ROLLOUT_INCONSISTENT)
    user = factories.job(suspend=True)  # the user's own suspend keeps its reason
    assert (
        cond(run(breach_status() | {"phase": Phase.SUSPENDED}, running_observed(), user), Cond.SUSPENDED)[
            "reason"
        ]
        == Reason.SUSPENDED_BY_USER
    )


# 1000 healthy steps of real statistics ----------------------------------------------------------------------


def _forward(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """TinyLM's forward in the trainer's fp32 (as demo/trainer.py trains it)."""
    h = params["embed_tokens"][ids]
    h = h + F.silu(h @ params["up_proj"].t()) @ params["down_proj"].t()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * params["norm"]
    return h @ params["lm_head"].t()


def training_reports(steps: int, stale_after: int | None = None) -> list[RolloutFigures]:
    """The demo's training, step by step: the engine (bf16 weights of the last update) samples, both sides
    score the sampled tokens, the trainer (fp32 master) takes an AdamW step, the engine gets its weights;
    after `stale_after` steps the engine gets none any more (an update skipped, reported as done)."""
    torch.manual_seed(0)
    engine = TinyLM(seed=0)
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in engine.named_parameters()}
    optimizer = torch.optim.AdamW(master.values(), lr=1e-2)
    vocab, data, out = 64, torch.arange(256) % 64, []
    for step in range(1, steps + 1):
        ids = torch.randint(0, vocab, (4, 8))
        with torch.no_grad():
            engine_lp = torch.log_softmax(engine.logits(ids), -1)
            tokens = torch.multinomial(engine_lp.exp().reshape(-1, vocab), 1).reshape(4, 8, 1)
            trainer_lp = torch.log_softmax(_forward(master, ids), -1).gather(-1, tokens)
        out.append(consistency.compare(trainer_lp, engine_lp.gather(-1, tokens)))
        start = torch.randint(0, len(data) - 17, (8,))
        batch = torch.stack([data[s : s + 17] for s in start])
        loss = F.cross_entropy(_forward(master, batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if stale_after is not None and step > stale_after:
            continue
        with torch.no_grad():
            for name, p in engine.named_parameters():
                p.copy_(master[name])  # the update: bf16 weights as the engine holds them
    return out


@pytest.mark.skipif(
    os.environ.get("COLOCATE_SLOW_TESTS") != "1", reason="slow set: set COLOCATE_SLOW_TESTS=1"
)
def test_a_thousand_healthy_training_steps_raise_no_alarm_and_a_stale_engine_does() -> None:
    reports = training_reports(1000)
    fold = RolloutFold()  # the CRD's defaults
    for step, figures in enumerate(reports, 1):
        fold.observe(rollout_event(step, figures))
        assert fold.breach is None, f"false alarm at step {step}: {fold.breach}"
    print(f"\n1000 healthy steps: KL max {max(f.kl for f in reports):.3g}, baseline {fold.baseline():.3g}")
    assert fold.breaches == 0 and fold.baseline() is not None
    # The same training whose engine stops getting updates after step 10 (the model still learning fast):
    # its first rollouts on stale weights breach.
    stale = RolloutFold()
    kls, first = [], None
    for step, figures in enumerate(training_reports(20, stale_after=10), 1):
        stale.observe(rollout_event(step, figures))
        kls.append(figures.kl)
        first = first or stale.breach
    assert first is not None, kls
    print(f"stale engine after step 10: first breach {first.message}")
    assert stale.breaches == 1 and first.step <= 13, kls  # one breach, all its steps


def rollout_event(step: int, figures: RolloutFigures) -> StepEvent:
    return StepEvent(role="trainer", gen=1, step=step, phase="rollout", result="ok", rollout=figures)
