"""The one-pass update on a GPU: the trainer's own storage exported over CUDA IPC and gathered straight into
SGLang's fused parameters by the tile kernel, two processes, checked bit for bit against the reference
conversion (bench/step_bench.py at a tiny size; skipped where there is no CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_bench.py"


def test_in_place_step_installs_the_reference_conversion_bit_for_bit() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--steps", "3", "--no-save", "--min-adopt-mb", "0"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["mode"] for r in rows} == {"inplace", "separate", "packed"}
    by_mode = {r["mode"]: r for r in rows}
    assert all(r["bitwise"] for r in rows), rows
    # In place: the Megatron-style buffer is one exported storage and nothing is packed.
    assert by_mode["inplace"]["handles"] == 1 and by_mode["inplace"]["packed_gb"] == 0
    assert by_mode["separate"]["handles"] >= 1  # min-adopt 0: even single parameters are exported
