"""The scale bench's order of runs and its report: ratios per repetition, median and spread, all runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scale import report
from bench.scale.__main__ import schedule


def result(operator: str, jobs: int, repeat: int, running: float | None, cpu: float, rss_mib: float) -> dict:
    empty: dict[str, Any] = {"total": 0, "errors": {}}
    return {
        "operator": operator,
        "jobs": jobs,
        "repeat": repeat,
        "complete": running is not None,
        "spec": {"steady_seconds": 60},
        "all_pods_running_seconds": running,
        "all_jobs_ready_seconds": running,
        "latency": {
            kind: {"p50": running, "p99": running, "max": running, "n": 1}
            for kind in ("pods_created", "pods_running", "job_ready")
        },
        "requests": {
            "startup": empty,
            "settle": empty,
            "steady": empty,
            "startup_per_job": 12.0,
            "steady_per_job_per_minute": 0.0,
            "status_writes_startup_per_job": 2.0,
            "status_writes_settle_per_job": 0.0,
            "status_writes_steady_per_job_per_minute": 0.0,
        },
        "operator_cpu_seconds": {"startup": cpu, "settle": 0.0, "steady": 0.0},
        "operator_rss_bytes": {"end": rss_mib * 2**20, "peak_vmhwm": rss_mib * 2**20, "peak_sampled": 0},
        "machine": {"busy_fraction_startup": 1.0},
        "final_state": {"jobs_with_stale_status": 0},
        "operator_log": {"error_lines": 0},
        "step_events": "not measured in this run",
    }


def test_operators_take_turns_within_each_size() -> None:
    assert schedule([250, 500], ["colocate", "kuberay"], 2) == [
        (250, 0, "colocate"),
        (250, 0, "kuberay"),
        (250, 1, "colocate"),
        (250, 1, "kuberay"),
        (500, 0, "colocate"),
        (500, 0, "kuberay"),
        (500, 1, "colocate"),
        (500, 1, "kuberay"),
    ]


def test_ratios_pair_the_runs_of_one_repetition_and_give_median_and_spread(tmp_path: Path) -> None:
    runs = [
        result("colocate", 250, 0, 40.0, 8.0, 110),
        result("kuberay", 250, 0, 40.0, 8.0, 100),
        result("colocate", 250, 1, 90.0, 6.0, 120),
        result("kuberay", 250, 1, 45.0, 4.0, 100),
        result("colocate", 250, 2, 30.0, 5.0, 100),
        result("kuberay", 250, 2, 60.0, 10.0, 100),
        result("colocate", 500, 0, None, 30.0, 150),  # stopped at its time bound: no time ratio
        result("kuberay", 500, 0, 100.0, 15.0, 100),
    ]
    found = report.ratios(runs, 250)
    assert found["all pods Running"] == [1.0, 2.0, 0.5]
    assert found["operator CPU"] == [1.0, 1.5, 0.5]
    assert report.spread(found["all pods Running"]) == "1.00 (0.50-2.00)"
    assert report.ratios(runs, 500)["all pods Running"] == []
    assert report.ratios(runs, 500)["operator CPU"] == [2.0]
    text = report.render(runs)
    assert "| 250 | 3 | 1.00 (0.50-2.00) |" in text
    assert "| 500 | ColocateJob (ours) | 0/1 complete |" in text
    assert text.count("| ColocateJob (ours) | ") == 4 + 2, "every run a row, and one median row per size"
    assert "INCOMPLETE" in text
    assert report.plot(runs, tmp_path)[0].stat().st_size > 10_000
