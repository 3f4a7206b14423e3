"""Benchmarks run from a plain checkout too (the GPU machine has no install): map `colocate_runtime` onto
./runtime when the package is not installed. Imported for its side effect by the bench scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_runtime() -> None:
    try:
        import colocate_runtime  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "colocate_runtime",
            ROOT / "runtime" / "__init__.py",
            submodule_search_locations=[str(ROOT / "runtime")],
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["colocate_runtime"] = module
        spec.loader.exec_module(module)


import_runtime()
