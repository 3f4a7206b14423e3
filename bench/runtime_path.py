"""Benchmarks run from a plain checkout too (the GPU machine has no install): map `colocate_runtime` onto
./runtime and `colocate_devcluster` (its local Redis launcher) onto ./devcluster when they are not installed.
Imported for its side effect by the bench scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"colocate_runtime": "runtime", "colocate_devcluster": "devcluster"}


def import_package(name: str, folder: str) -> None:
    if importlib.util.find_spec(name) is not None:
        return
    spec = importlib.util.spec_from_file_location(
        name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


for _name, _folder in PACKAGES.items():
    import_package(_name, _folder)
