"""`make demo` end to end, shortened: the chart, the operator, the example job, real weight-update steps
through the real Redis, and every step visible in the job's status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_demo_runs_weight_update_steps_into_status(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_STEP_SECONDS": "0.2"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "run.py"), "--steps", "3", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "demo succeeded" in out
    summary = out[out.index("7/7 summary") :]
    rows = [line.split() for line in summary.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert all(row[3] == "Succeeded" and row[-3:] == ["yes,", "every", "pod"] for row in rows)
    assert "WeightSyncHealthy=True" in summary and "Succeeded=True" in summary
    assert "RolloutConsistent=True" in summary  # the trainer reported its rollouts every step (issue 32)
