"""The operator image: lint the Dockerfile and run its install steps in a fresh virtual environment (no
Docker engine runs here, so the build stage's RUN instruction is executed as a shell command)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def build_stage_run() -> str:
    """The RUN instruction of the first (build) stage, with line continuations joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    first_stage = text.split("\nFROM ", 2)[0 if text.startswith("FROM") else 1]
    (run,) = re.findall(r"^RUN (.+)$", first_stage, flags=re.MULTILINE)
    return run


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_non_root_and_runs_the_operator() -> None:
    text = DOCKERFILE.read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER 10001", final, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["colocate-operator"]' in final
    assert all(
        ":" in line.split()[1] and "latest" not in line for line in re.findall(r"^FROM .+$", text, re.M)
    )


@pytest.mark.integration
@pytest.mark.skipif(
    os.environ.get("COLOCATE_SLOW_TESTS") != "1",
    reason="slow set (COLOCATE_SLOW_TESTS=1): make test builds the image from this Dockerfile with buildah "
    "and runs it (tests/realnode/test_realnode.py::test_operator_deployment_from_the_chart_becomes_ready_on_"
    "the_real_node)",
)
def test_install_steps_work_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    command = build_stage_run().replace("/opt/venv", str(venv)).replace("/src", str(ROOT))
    command = command.replace("python -m venv", f"{sys.executable} -m venv", 1)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    python = venv / "bin" / "python"
    check = subprocess.run(
        [str(python), "-c", "import colocate_operator.handlers, kopf, kubernetes, redis, prometheus_client"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    # Only the operator's dependencies: the runtime's torch stays out of the operator image.
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
