"""The image recipes under images/ (hadolint-clean; non-root; bases by digest where the base is upstream's).
`make images` builds runtime and redis (tests/realnode); trainer and sglang need registries: not built."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "images").glob("*/Dockerfile"))


def test_the_four_recipes_exist() -> None:
    assert {p.parent.name for p in RECIPES} == {"runtime", "redis", "trainer", "sglang"}


@pytest.mark.parametrize("dockerfile", RECIPES, ids=lambda p: p.parent.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", RECIPES, ids=lambda p: p.parent.name)
def test_runs_as_a_numeric_non_root_user_from_a_pinned_base(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.MULTILINE)
    assert int(user[0]) != 0
    (base,) = re.findall(r"^FROM (.+)$", text, flags=re.MULTILINE)
    # Either a default pinned by digest, or a digest argument without a default (the build must pass it).
    digest_arg = re.search(r"^ARG (\w*DIGEST)$", text, flags=re.MULTILINE)
    assert "@sha256:" in text or (digest_arg and f"@${{{digest_arg.group(1)}}}" in base), base
