"""`python -m colocate_runtime.sglang.serve ARGS` is `python -m sglang.launch_server ARGS` plus the API key
from `SGLANG_API_KEY` (which the operator sets from `spec.rollout.apiKeySecretRef`).

SGLang reads its key only from `--api-key` (or a `--config` YAML file). `--api-key $(SGLANG_API_KEY)` in the
pod's args would be expanded by the kubelet into the command line, which every process in the pod's shared
PID namespace, and the node, can read in /proc/<pid>/cmdline. Here the flag is added to `sys.argv` inside
the process: /proc keeps the command line as executed, and SGLang's workers (multiprocessing `spawn`) get
their arguments through a pipe. SGLang also logs its arguments, key included, at start; log records that
contain the key are redacted here, in the server and in every worker (each re-imports this module).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Mapping
from typing import Any

API_KEY_ENV = "SGLANG_API_KEY"
REDACTED = "<redacted>"


class KeyOnCommandLine(SystemExit):
    pass


def api_key(environ: Mapping[str, str]) -> str | None:
    return environ.get(API_KEY_ENV, "").strip() or None


def with_api_key(argv: list[str], environ: Mapping[str, str]) -> list[str]:
    """`argv` plus `--api-key KEY` when the environment has a key; a key on the command line too is refused
    (it would be readable by every process of the pod)."""
    key = api_key(environ)
    if key is None:
        return list(argv)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        raise KeyOnCommandLine(
            f"colocate serve: {API_KEY_ENV} is set and --api-key is on the command line; drop the flag, "
            "the key in the environment is passed to SGLang without a command line"
        )
    return [*argv, "--api-key", key]


def redact_logs(secret: str) -> None:
    """Every log record of this process whose message contains `secret` gets it replaced. A record factory,
    not a handler filter: SGLang replaces the root handlers (`basicConfig(force=True)`) at start."""
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report, not ours
            return record
        if secret in message:
            record.msg, record.args = message.replace(secret, REDACTED), None
        return record

    logging.setLogRecordFactory(factory)


_key = api_key(os.environ)
if _key is not None:
    redact_logs(_key)  # at import: runs again in every spawned worker, which imports this as __mp_main__


def main() -> None:
    sys.argv = [sys.argv[0], *with_api_key(sys.argv[1:], os.environ)]
    # alter_sys=False keeps this module as __main__, so spawn children import it and redact their logs too.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
