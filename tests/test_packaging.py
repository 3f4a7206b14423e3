"""Every Python package in the tree ships in the wheel, and none shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {directory: name for name, directory in config["package-dir"].items()}
    found = set()
    for directory, name in roots.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory).parts
            found.add(".".join((name, *relative)))
    assert found == set(config["packages"])


def test_stdlib_operator_stays_importable_from_the_repository_root() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    code = "import sys; sys.path.insert(0, '.'); import operator; print(operator.itemgetter.__module__)"
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == "operator", result.stderr
