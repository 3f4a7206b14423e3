"""`python -m bench.scale.colocate_with_steps ARGS`: our operator exactly as `python -m colocate_operator
ARGS`, plus colocate_operator.stepwatch's step-event handlers when the entry point does not register them
itself (operator versions before 4dbf610), for the status-writes-per-step run.

For finding where the operator's memory goes: with COLOCATE_BENCH_TRACEMALLOC=DIR set, Python's tracemalloc
runs (it slows the operator down: never for figures) and every TRACEMALLOC_EVERY seconds the largest
allocation sites are written to DIR/<seconds since start>.txt.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from colocate_operator import __main__ as cli
from colocate_operator import stepwatch

_register = cli.handlers.register


def has_step_handlers(registry: Any) -> bool:
    # Since the one job-event handler also starts the followers, the followers' startup handler says so.
    activities = getattr(registry, "_activities", None)
    if activities is not None and any(str(h.id) == "start-steps" for h in activities.get_all_handlers()):
        return True
    for part in ("_watching", "_spawning", "_changing"):
        handlers = getattr(registry, part, None)
        if handlers is not None and any(str(h.id) == "steps" for h in handlers.get_all_handlers()):
            return True
    return False


TRACEMALLOC_EVERY = 5.0
TRACEMALLOC_TOP = 40


def dump_allocations_every(folder: Path, every: float = TRACEMALLOC_EVERY) -> None:
    """Starts tracemalloc and a daemon thread writing the top allocation sites (by line) every `every` s."""
    folder.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(1)
    started = time.monotonic()

    def loop() -> None:
        while True:
            time.sleep(every)
            snapshot = tracemalloc.take_snapshot()
            stats = snapshot.statistics("lineno")
            current, peak = tracemalloc.get_traced_memory()
            lines = [f"traced {current / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"]
            lines += [str(stat) for stat in stats[:TRACEMALLOC_TOP]]
            (folder / f"{time.monotonic() - started:06.0f}.txt").write_text("\n".join(lines) + "\n")

    threading.Thread(target=loop, name="tracemalloc-dump", daemon=True).start()


def register(registry: Any, config: Any, kube: Any = None, **kwargs: Any) -> None:
    _register(registry, config, kube, **kwargs)
    if not has_step_handlers(registry):
        stepwatch.register(registry, config)


if __name__ == "__main__":
    if os.environ.get("COLOCATE_BENCH_TRACEMALLOC"):
        dump_allocations_every(Path(os.environ["COLOCATE_BENCH_TRACEMALLOC"]))
    cli.handlers.register = register  # type: ignore[assignment]
    sys.exit(cli.main())
