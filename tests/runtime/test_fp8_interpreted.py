"""test_fp8_copy.py and test_fp8_gather.py's kernel cases check the quantize-on-copy kernel under
TRITON_INTERPRET=1, which Triton honours only if it is set before Triton's first import. In a whole-suite run
something imports Triton first and those cases skip themselves; this runs both modules in a fresh process
where the kernel is interpreted, so no run leaves the kernel unchecked on a machine without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(600)
HERE = Path(__file__).parent
KERNEL_TESTS = [HERE / "test_fp8_copy.py", HERE / "test_fp8_gather.py"]


def test_the_kernel_tests_ran_interpreted_here_or_in_a_fresh_process() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA: test_fp8_copy_gpu.py checks the kernel on the GPU")
    triton = sys.modules.get("triton")
    if triton is None or triton.knobs.runtime.interpret:
        pytest.skip("Triton is interpreted in this process: test_fp8_copy.py ran here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, KERNEL_TESTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=HERE.parents[1],
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
