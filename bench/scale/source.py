"""Which operator code is measured: a snapshot of a commit (default HEAD), not the shared work tree, where
other people's unfinished edits would change the operator between (or during) runs.

`git archive` extracts operator/ and runtime/ of the commit; the operator subprocess gets a PYTHONPATH whose
`colocate_operator` and `colocate_runtime` packages are that snapshot (ahead of the editable install).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class OperatorSource:
    commit: str  # "" for the work tree as it is
    pythonpath: str  # "" for the work tree
    crd: Path


def snapshot(ref: str, dest: Path) -> OperatorSource:
    """`ref` "worktree" measures the work tree as it is; anything else is a git revision."""
    if ref == "worktree":
        return OperatorSource("", "", ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    tree = dest / commit[:12]
    if not (tree / "pkgs").is_dir():
        (tree / "src").mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "operator", "runtime"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree / "src")], input=archive, check=True, timeout=120)
        (tree / "pkgs").mkdir()
        (tree / "pkgs" / "colocate_operator").symlink_to(tree / "src" / "operator" / "colocate_operator")
        (tree / "pkgs" / "colocate_runtime").symlink_to(tree / "src" / "runtime")
    return OperatorSource(
        commit, str(tree / "pkgs"), tree / "src" / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"
    )
