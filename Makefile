# The two commands: `make test` and `make demo`. Both run `make setup` first; it is idempotent and quick
# once everything is installed.
SHELL := /bin/bash
PY := .venv/bin/python
BIN_DIR = $$(bash scripts/build-tools.sh)

.PHONY: setup test test-unit lint demo cluster-up cluster-down chart-crd images

setup:
	@bash scripts/setup.sh

lint: setup
	@.venv/bin/ruff check .
	@.venv/bin/ruff format --check .
	@.venv/bin/lint-imports --no-logo --no-cache

## Everything: lint, unit tests and integration tests against a real local control plane and Redis.
## Two pytest-xdist workers, a module per worker at a time (tests/conftest.py groups them); PYTEST_WORKERS=0
## runs one process (on a machine already loaded by other work: README, "Times").
PYTEST_WORKERS ?= 2
test: lint
	@COLOCATE_BIN_DIR=$(BIN_DIR) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope --durations=30 $(PYTEST_ARGS)

## Fast tests only (no control plane).
test-unit: setup
	@$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

## DEMO_ARGS=--real-node: on real containers (images built here, the operator as the chart's Deployment on a
## real kubelet; needs root; README, "A real node and images built here").
demo: setup
	@COLOCATE_BIN_DIR=$(BIN_DIR) bash scripts/demo.sh

cluster-up: setup
	@COLOCATE_BIN_DIR=$(BIN_DIR) $(PY) -m colocate_devcluster up

cluster-down:
	@$(PY) -m colocate_devcluster down

## The chart ships a copy of the CRD (Helm installs crds/ before templates); a test checks they match.
chart-crd:
	@cp operator/crds/colocatejobs.colocate.dev.yaml charts/colocate-operator/crds/

## Container images built here without a registry (Debian base by mmdebstrap, pause, the operator from the
## Dockerfile); cached, skipped when their inputs did not change. Needs root.
images: setup
	@bash scripts/build-images.sh >/dev/null
