#!/usr/bin/env bash
# `make demo`: the whole product end to end on this machine (see demo/run.py); `make demo DEMO_ARGS=--keep`
# leaves the local cluster running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python demo/run.py ${DEMO_ARGS:-}
