"""`python -m bench.scale.colocate_with_steps ARGS`: our operator exactly as `python -m colocate_operator
ARGS`, plus colocate_operator.stepwatch's step-event handlers when the entry point does not register them
itself (operator versions before 4dbf610), for the status-writes-per-step run.
"""

from __future__ import annotations

import sys
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


def register(registry: Any, config: Any, kube: Any = None, **kwargs: Any) -> None:
    _register(registry, config, kube, **kwargs)
    if not has_step_handlers(registry):
        stepwatch.register(registry, config)


if __name__ == "__main__":
    cli.handlers.register = register  # type: ignore[assignment]
    sys.exit(cli.main())
