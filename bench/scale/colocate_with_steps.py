"""`python -m bench.scale.colocate_with_steps ARGS`: our operator exactly as `python -m colocate_operator
ARGS`, plus the step-event daemon of colocate_operator.stepwatch, for the status-writes-per-step run.

At the time of writing the operator's entry point does not register that daemon yet; once it does, this
launcher adds nothing (it never registers it twice).

With BENCH_WEIGHT_VERSION_SHIM=1 it also makes the daemon write status.weightSync.weightVersion as the
integer the CRD declares: the daemon writes the stream's string, and the apiserver rejects every such status
write (422). The shim stands in for that fix so the coalescing of writes can be measured; it does nothing
once the operator writes an integer itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from colocate_operator import __main__ as cli
from colocate_operator import steps, stepwatch

_register = cli.handlers.register


def _has_steps_daemon(registry: Any) -> bool:
    try:
        return any(str(h.id) == "steps" for h in registry._spawning.get_all_handlers())
    except AttributeError:
        return False


def register(registry: Any, config: Any, kube: Any = None) -> None:
    _register(registry, config, kube)
    if not _has_steps_daemon(registry):
        stepwatch.register(registry, config)


def _integer_weight_version() -> None:
    original = steps.StepTracker.weight_sync_status

    def weight_sync_status(self: steps.StepTracker) -> dict[str, Any]:
        status = original(self)
        version = status.get("weightVersion")
        if isinstance(version, str) and version.isdigit():
            status["weightVersion"] = int(version)
        return status

    steps.StepTracker.weight_sync_status = weight_sync_status  # type: ignore[method-assign]


if __name__ == "__main__":
    cli.handlers.register = register  # type: ignore[assignment]
    if os.environ.get("BENCH_WEIGHT_VERSION_SHIM") == "1":
        _integer_weight_version()
    sys.exit(cli.main())
