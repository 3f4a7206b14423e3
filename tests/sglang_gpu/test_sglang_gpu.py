"""GPU tier: the REAL SGLang 0.5.17 on one GPU, our loader in its scheduler, weights over real CUDA IPC.

Runs `bench/sglang_gpu.py check` (its docstring lists the checks; the `_fp8` architectures serve block FP8
from a BF16 trainer) and asserts that every check passed. Needs CUDA and SGLang importable, which only the
H200 run sets up:

    device run, carry [".device/sglang-gpu"], command "bash bench/colocated_device.sh sglang-gpu check"

(`bash scripts/sglang-gpu-carry.sh` here first). Skipped everywhere else, CI included.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (the device carry)"),
]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_fp8", "qwen3_moe_fp8"])
def test_real_sglang_installs_our_weights_bitwise(arch: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sglang_gpu.py"), "check", "--arch", arch, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    failed = [c for r in report["reports"] for c in r["checks"] if not c["ok"]]
    assert report["ok"] and not failed, json.dumps(failed, indent=1)[:4000]
