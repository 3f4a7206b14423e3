"""Prometheus metrics on /metrics (prometheus_client's own HTTP server, started once)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram, start_http_server

SYNC_SECONDS = Histogram(
    "colocate_weight_sync_seconds",
    "Duration of completed weight-update steps (slowest GPU of the job).",
    ["namespace", "job"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LAST_COMPLETED_STEP = Gauge(
    "colocate_last_completed_step", "Last weight-update step completed on every GPU.", ["namespace", "job"]
)
FAILED_STEPS = Counter(
    "colocate_failed_steps_total", "Weight-update steps that failed.", ["namespace", "job"]
)
ROLLOUT_KL = Gauge(
    "colocate_rollout_kl",
    "K3 KL of the engine's log-probs of its sampled tokens against the trainer's, last reported step.",
    ["namespace", "job"],
)
ROLLOUT_KL_BASELINE = Gauge(
    "colocate_rollout_kl_baseline",
    "Rolling baseline of the rollout KL (healthy steps).",
    ["namespace", "job"],
)
ROLLOUT_LOGP_DIFF_MEAN = Gauge(
    "colocate_rollout_logp_diff_mean", "Mean absolute log-prob difference, last step.", ["namespace", "job"]
)
ROLLOUT_LOGP_DIFF_MAX = Gauge(
    "colocate_rollout_logp_diff_max", "Largest absolute log-prob difference, last step.", ["namespace", "job"]
)
ROLLOUT_CONSISTENT = Gauge(
    "colocate_rollout_consistent",
    "1 while the last rollout report is within spec.weightSync.rolloutConsistency, else 0.",
    ["namespace", "job"],
)
ROLLOUT_BREACHES = Counter(
    "colocate_rollout_breaches_total",
    "Rollout consistency breaches reported (each with an Event).",
    ["namespace", "job"],
)
RESTARTS = Gauge("colocate_job_restarts", "Whole-group restarts of a job so far.", ["namespace", "job"])
RECONCILE_ERRORS = Counter("colocate_reconcile_errors_total", "Reconcile passes that raised an error.")
STATUS_WRITES = Counter("colocate_status_writes_total", "Status patches written.", ["writer"])


def serve(port: int) -> None:
    start_http_server(port, addr="0.0.0.0")


def forget_job(namespace: str, job: str) -> None:
    """Drop a deleted job's series so the registry does not grow with every job ever seen."""
    for metric in (
        SYNC_SECONDS,
        LAST_COMPLETED_STEP,
        FAILED_STEPS,
        RESTARTS,
        ROLLOUT_KL,
        ROLLOUT_KL_BASELINE,
        ROLLOUT_LOGP_DIFF_MEAN,
        ROLLOUT_LOGP_DIFF_MAX,
        ROLLOUT_CONSISTENT,
        ROLLOUT_BREACHES,
    ):
        with contextlib.suppress(KeyError):
            metric.remove(namespace, job)
