#!/usr/bin/env bash
# `make demo`: the whole product end to end on this machine (see demo/run.py); `make demo DEMO_ARGS=--keep`
# leaves the local cluster running afterwards; `make demo DEMO_ARGS=--real-node` runs it on real containers
# (images built here, a real kubelet; needs root, minutes: demo/realnode_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python demo/run.py ${DEMO_ARGS:-}
