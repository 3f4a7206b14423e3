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
RESTARTS = Gauge("colocate_job_restarts", "Whole-group restarts of a job so far.", ["namespace", "job"])
RECONCILE_ERRORS = Counter("colocate_reconcile_errors_total", "Reconcile passes that raised an error.")
STATUS_WRITES = Counter("colocate_status_writes_total", "Status patches written.", ["writer"])


def serve(port: int) -> None:
    start_http_server(port, addr="0.0.0.0")


def forget_job(namespace: str, job: str) -> None:
    """Drop a deleted job's series so the registry does not grow with every job ever seen."""
    for metric in (SYNC_SECONDS, LAST_COMPLETED_STEP, FAILED_STEPS, RESTARTS):
        with contextlib.suppress(KeyError):
            metric.remove(namespace, job)
