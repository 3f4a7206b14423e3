"""The GPU tier's model-class check (bench/sglang_gpu_classes.py) on CPU, against the CPU tier's real SGLang:
SGLang 0.5.23's own Qwen3-MoE class built without a server, our loader's install (`load_colocated_step`, over
shared memory here, CUDA IPC on the H200) bitwise equal to the published weights and to SGLang's own
`load_weights` of them, parameter addresses kept, for two steps.

About 60 to 100 s on the 2 shared cores here (SGLang's import and two engine-side builds dominate), so it
is opt-in: `COLOCATE_SGLANG_CLASSES=1 .venv/bin/python -m pytest tests/sglang_gpu/test_classes_cpu.py`. Not in
`make test`. On the H200: `bash bench/colocated_device.sh sglang-classes` (both versions, both architectures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang_real.server import pythonpath

REPO = Path(__file__).resolve().parents[2]
OPT_IN = "COLOCATE_SGLANG_CLASSES"

pytestmark = [
    pytest.mark.integration,  # Redis
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"about 60-100 s; set {OPT_IN}=1 to run"),
]


@pytest.mark.parametrize(("version", "arch"), [("0.5.23", "qwen3_moe")])
def test_sglang_model_class_takes_our_install_bitwise(version: str, arch: str, tmp_path: Path) -> None:
    out = tmp_path / "lines.jsonl"
    env = {**os.environ, "PYTHONPATH": pythonpath(version)}
    cmd = [sys.executable, str(REPO / "bench" / "sglang_gpu_classes.py"), "--device", "cpu", "--arch", arch]
    cmd += ["--no-record", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["sglang_version"] == version and line["arch"] == arch
    assert line["ok"] and line["bitwise"] and line["addresses_kept"] and line["steps"] == 2, json.dumps(line)
