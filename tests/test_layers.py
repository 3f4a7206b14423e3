"""The import contracts in pyproject.toml hold for the tree, and `lint-imports` (run by `make lint`) fails on
a violation: one forbidden import added to a copy of the three packages breaks the contract it names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# The import names, mapped from folders as pyproject's package-dir maps them.
PACKAGES = {
    "colocate_operator": ROOT / "operator" / "colocate_operator",
    "colocate_runtime": ROOT / "runtime",
    "colocate_devcluster": ROOT / "devcluster",
}


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache"],
        cwd=cwd,
        # Wide enough that no contract's name is wrapped across lines in the report.
        env={**(env or os.environ), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken" in done.stdout, done.stdout


# (module of the copy, the import added to it, a contract that must then be reported broken)
VIOLATIONS = [
    (
        "colocate_operator/steps.py",
        "from colocate_runtime.colocated import buckets",
        "The operator imports from the runtime only the contract package",
    ),
    (
        "colocate_runtime/contract/events.py",
        "import torch",
        "The contract is torch-free, redis-free and imports no other runtime module",
    ),
    (
        "colocate_runtime/contract/env.py",
        "from colocate_runtime.colocated import config",
        "The contract is torch-free, redis-free and imports no other runtime module",
    ),
    (
        "colocate_runtime/p2p/layout.py",
        "from colocate_devcluster import Cluster",
        "The runtime never imports the operator or the devcluster",
    ),
    (
        "colocate_runtime/convert/spec.py",
        "from colocate_runtime.p2p import plan",
        "convert is independent of p2p",
    ),
    (
        "colocate_runtime/p2p/plan.py",
        "from colocate_runtime.p2p import executor",
        "p2p: torch-free planning below the torch modules",
    ),
    (
        "colocate_runtime/colocated/manifest.py",
        "from colocate_runtime.colocated import transport",
        "colocated: data below transports and services below copy programs below facades",
    ),
    (
        "colocate_operator/decide.py",
        "from colocate_operator import kube",
        "operator: the pure layer (decisions, builders, spec, status) does no I/O",
    ),
    (
        "colocate_operator/spec.py",
        "import threading",
        "operator: the pure layer (decisions, builders, spec, status) does no I/O",
    ),
    (
        "colocate_operator/status.py",
        "from colocate_operator import steps",
        "operator: wiring above I/O services above decisions above builders above plain data",
    ),
]


@pytest.mark.parametrize(("module", "line", "contract"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_one_forbidden_import_fails_naming_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    for name, folder in PACKAGES.items():
        shutil.copytree(folder, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}\n")
    # The copies shadow the editable install: the path finder runs before setuptools' editable finder.
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = lint_imports(tmp_path, env)
    assert done.returncode != 0, done.stdout
    broken = re.findall(r"^(.+) BROKEN(?: \(.*\))?$", done.stdout, flags=re.MULTILINE)
    # One import may break several contracts (a facade pulled into the data layer also brings in torch).
    assert contract in broken, done.stdout
