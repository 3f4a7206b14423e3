"""bench.scale's paced creation (--rate) and the projection past this machine (bench.scale.projection)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

from bench.scale import projection
from bench.scale.run import RunSpec, _create_jobs, _Timeline
from bench.scale.workloads import WORKLOADS


class RecordingBed:
    """Stands in for the testbed's API client only: records when each create was sent (no cluster is needed
    to check the harness's own pacing)."""

    redis = None

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.api = self

    def create(self, path: str, body: dict[str, Any]) -> None:
        self.sent.append(time.time())


def test_jobs_are_created_at_the_rate_asked_and_all_at_once_without_one() -> None:
    bed, tl = RecordingBed(), _Timeline()
    created = _create_jobs(bed, WORKLOADS["colocate"], "ns", 6, tl, rate=20.0)  # type: ignore[arg-type]
    assert len(created) == 6
    offsets = [at - tl.t0 for at in bed.sent]
    assert all(at >= i / 20.0 for i, at in enumerate(offsets)), offsets  # never ahead of the schedule
    assert offsets[-1] >= 5 / 20.0
    bed = RecordingBed()
    _create_jobs(bed, WORKLOADS["colocate"], "ns", 6, _Timeline())  # type: ignore[arg-type]
    assert bed.sent[-1] - bed.sent[0] < 5 / 20.0


def test_a_paced_run_has_its_own_namespace_and_waits_for_its_creates_too() -> None:
    paced, burst = RunSpec("colocate", 250, rate=2.5), RunSpec("colocate", 250)
    assert paced.label == "colocate-250-r2p5-0" and burst.label == "colocate-250-0"
    assert paced.timeout == burst.timeout + 100.0


def run(jobs: int, startup_cpu: float, rss_mib: float, steady_cpu: float) -> dict[str, Any]:
    return {
        "operator": "colocate",
        "complete": True,
        "jobs": jobs,
        "spec": {"steady_seconds": 60.0},
        "operator_cpu_seconds": {"startup": startup_cpu, "steady": steady_cpu},
        "requests": {"startup_per_job": 11.0},
        "operator_rss_bytes": {
            "peak_sampled_before_steps": rss_mib * 2**20,
            "peak_vmhwm": (rss_mib + 10) * 2**20,
            "peak_sampled": 0,
        },
        "step_events": {"steps": 10, "operator_cpu_seconds": jobs * 10 * 0.002},
    }


def test_the_projection_fits_fixed_plus_per_job_and_names_each_limit(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    runs = [run(100, 3.0, 70.0, 0.01), run(300, 9.0, 90.0, 0.03), run(300, 9.0, 90.0, 0.03)]
    runs.append({**run(50, 99.0, 999.0, 9.0), "operator": "kuberay"})  # not ours: left out
    results.write_text(json.dumps({"meta": {}, "runs": runs}))
    fitted = projection.models(projection.ours([results]))
    assert abs(fitted["cpu_up_s"].per_job - 0.03) < 1e-9 and abs(fitted["cpu_up_s"].fixed) < 1e-9
    assert abs(fitted["rss_up_mib"].at(1000) - 160.0) < 1e-6  # 60 MiB fixed + 0.1 MiB a job
    assert projection.step_cost(runs[:3]) == 0.002
    argv = [str(results), "--jobs", "5000", "--resync-ms-per-job", "4", "--memory-limit-mib", "512"]
    text = _main_output(argv)
    assert "| 5000 | 150 | 55000 | 560 / 570 |" in text, text
    assert "memory limit 512 MiB at the step peak: 4420" in text  # (512 - 70) / 0.1
    assert "the resync at 10% of a core: 3000" in text  # 0.1 x 120 s / 4 ms


def _main_output(argv: list[str]) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert projection.main(argv) == 0
    return buffer.getvalue()
