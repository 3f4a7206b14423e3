"""Rollout consistency at the job: metrics, one Event per breach, and the action the spec picks.

The trainer's rollout reports fold into `steps.RolloutFold` (pure); the step follower (stepwatch.py) writes
what it holds into status, then calls `after_write`: the gauges follow the last report, and a breach not yet
reported gets one Warning Event `RolloutInconsistent` and spec.weightSync.rolloutConsistency.action:
- Report: nothing more;
- SuspendAtStepBoundary: the operator sets the job's spec.suspend, so the reconciler's own suspend path runs
  (the weight sync in flight finishes, a trainer registered for checkpoint requests checkpoints, then the
  pods go); the user resumes with spec.suspend=false. A breach is reported once: a resumed trainer (a new
  incarnation) that breaches again is a new breach;
- Fail: the reconciler fails the job from the RolloutConsistent condition (decide.py, `rollout_failure`).
A breach is marked reported only after its Event and action went out, so a refused patch is tried again with
the next write; a restarted follower reports no breach that began before the newest one status shows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from colocate_operator import kube, metrics
from colocate_operator.constants import Reason
from colocate_operator.kube_events import post_event
from colocate_operator.spec import RolloutConsistencySpec
from colocate_operator.status import RolloutStatus, StatusView
from colocate_operator.steps import Breach, RolloutFold

ACTION_WORDS = {
    "Report": "reported (action Report)",
    "SuspendAtStepBoundary": "suspending the job at the next step boundary (action SuspendAtStepBoundary; "
    "resume with spec.suspend=false)",
    "Fail": "failing the job (action Fail)",
}


def fold_for(policy: RolloutConsistencySpec, job: dict[str, Any]) -> RolloutFold:
    """The fold of a job the follower starts on: its policy, and the breaches its status already counted."""
    return RolloutFold(policy=policy, reported_since=StatusView.of(job).rollout_breach_since)


@dataclass(frozen=True)
class RolloutNews:
    """What one status write carried and leaves to report: its figures, and its newest breach when the
    follower has not reported it yet (never one the write did not carry: status shows a breach first)."""

    kl: float
    baseline: float | None
    diff_mean: float
    diff_max: float
    consistent: bool
    breach: Breach | None
    action: str

    @classmethod
    def of(cls, fold: RolloutFold, written: RolloutStatus | None) -> RolloutNews | None:
        c = written.consistency if written is not None else None
        if c is None:
            return None
        since = StatusView({"rollout": written.model_dump(by_alias=True)}).rollout_breach_since
        due = c.last_breach_step is not None and since > fold.reported_since
        breach = Breach(c.last_breach_step or 0, "", c.last_breach or "", since) if due else None
        consistent = c.last_breach_step != c.step
        return cls(
            c.kl, c.baseline_kl, c.logp_diff_mean, c.logp_diff_max, consistent, breach, fold.policy.action
        )


def publish(api: kube.Kube, body: dict[str, Any], news: RolloutNews) -> None:
    """The gauges; on a breach not yet reported, the action and then its Event (blocking: the followers'
    thread pool). Raises KubeError when the suspend patch is refused (the next write tries again)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    metrics.ROLLOUT_KL.labels(namespace, name).set(news.kl)
    metrics.ROLLOUT_LOGP_DIFF_MEAN.labels(namespace, name).set(news.diff_mean)
    metrics.ROLLOUT_LOGP_DIFF_MAX.labels(namespace, name).set(news.diff_max)
    metrics.ROLLOUT_CONSISTENT.labels(namespace, name).set(1 if news.consistent else 0)
    if news.baseline is not None:
        metrics.ROLLOUT_KL_BASELINE.labels(namespace, name).set(news.baseline)
    if news.breach is None:
        return
    if news.action == "SuspendAtStepBoundary":
        suspend(api, body)
    metrics.ROLLOUT_BREACHES.labels(namespace, name).inc()
    words = ACTION_WORDS.get(news.action, news.action)
    post_event(api, body, "Warning", Reason.ROLLOUT_INCONSISTENT, f"{news.breach.message}; {words}")


def suspend(api: kube.Kube, body: dict[str, Any]) -> None:
    """spec.suspend=true on this very job (its uid a precondition: never a job of that name made anew)."""
    meta = body["metadata"]
    patch = {"metadata": {"uid": meta.get("uid")}, "spec": {"suspend": True}}
    api.patch(kube.COLOCATE_JOBS, meta["namespace"], meta["name"], patch)


async def after_write(
    call: Callable[..., Awaitable[Any]],
    api: kube.Kube,
    body: dict[str, Any],
    fold: RolloutFold,
    written: RolloutStatus | None,
) -> None:
    """After a status write that carried `written` (so status and condition show a breach before its Event
    and action): `call` runs `publish` off the event loop; the breach counts as reported once it returned."""
    news = RolloutNews.of(fold, written)
    if news is None:
        return
    await call(publish, api, body, news)
    if news.breach is not None:
        fold.reported_since = max(fold.reported_since, news.breach.since)
