"""SGLang plugin (entry point group `sglang.srt.plugins`, SGLang >= 0.5.11): start the colocated worker side
when each TP worker starts, not at the first update.

SGLang loads every installed general plugin at the top of each scheduler process (`load_plugins()`); this one
registers a hook after `ModelRunner.__init__`, when the worker's device and TP group are set, that starts the
IPC preflight responder (loader.start_preflight). It does nothing outside a ColocateJob's SGLang container
(no `COLOCATE_JOB_NAME`), for draft models, and with the preflight Off. It never raises: a plugin error would
stop SGLang from starting, and the rollout's init call (rollout.py) is the second way in.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from colocate_runtime.contract import env

log = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.__init__"


def register() -> None:
    if not os.environ.get(env.JOB_NAME.name, "").strip():  # not in a ColocateJob's pod: nothing to start
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # type: ignore[import-not-found]

        HookRegistry.register(HOOK_TARGET, after_model_runner_init, HookType.AFTER)
    except Exception as err:
        log.warning("colocate plugin not registered (%s); the rollout's init call starts the worker", err)


def after_model_runner_init(result: Any, runner: Any = None, *args: Any, **kwargs: Any) -> Any:
    if runner is not None and getattr(runner, "is_draft_worker", False):
        return result
    try:
        from colocate_runtime.sglang.loader import start_preflight

        start_preflight()
    except Exception as err:
        log.exception("colocate plugin: preflight responder not started (%s)", err)
    return result
