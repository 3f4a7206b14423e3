#!/usr/bin/env bash
# Builds (once) an import path holding slime's own source at a pinned commit and the packages its trainer
# modules import, next to the torch and transformers of the project's .venv (tests/slime_real imports slime's
# Megatron actor and weight-update code from it):
#
#   PYTHONPATH=$(bash scripts/megatron-env.sh 0.16.1):$(bash scripts/sglang-env.sh 0.5.23):$(bash scripts/slime-env.sh) \
#     .venv/bin/python -c 'import slime.backends.megatron_utils.actor'
#
# slime (THUDM/slime) is not on PyPI (the `slime` there is an unrelated statistics package), and a test
# machine reaches only the registries, not GitHub: its source comes from third_party/slime/, an unmodified
# copy of the `slime/` package and LICENSE at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
# (third_party/slime/README.md says how it was made and how to check it). The packages slime imports at
# module level are installed from PyPI, pinned (`pip install --no-deps --target`, binary wheels only): ray,
# wandb (and what it imports), torch_memory_saver. One thing cannot be installed: Megatron-LM's
# `megatron.training` (not on PyPI; megatron-core ships `megatron.core` only), for which
# tests/slime_real/stubs/ gives import-only names. megatron-core and SGLang come from their own scripts (put
# them FIRST on PYTHONPATH: their pins win where both have a package).
#
# The result lives in ${COLOCATE_CACHE_DIR:-~/.cache/colocate-operator}/slime-COMMIT-HASH, HASH covering this
# script, the vendored source and the stubs; a second call only prints the path. The only stdout line is the
# PYTHONPATH to add; progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
commit=624b824a898ab0ec1fcb4d373004c7f3852bf515
say() { printf '[slime-env] %s\n' "$*" >&2; }

# ray 2.60.0 and wandb 0.31.0 with the dependencies the project's .venv lacks (pip's resolver, 2026-12-03).
packages=(
  ray==2.60.0 wandb==0.31.0 torch_memory_saver==0.0.10
  cwevals==0.0.1b1 protobuf==7.36.2 googleapis-common-protos==1.76.0 platformdirs==4.14.9
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 distro==1.9.0 xxhash==4.1.0
)

vendored=$root/third_party/slime
stubs=$root/tests/slime_real/stubs
[ -f "$vendored/slime/__init__.py" ] || { say "missing $vendored/slime (the vendored source)"; exit 2; }
hash=$( { cat "$0"; find "$vendored" "$stubs" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' \
  | LC_ALL=C sort | xargs cat; } | sha256sum | cut -c1-12)
cache=${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}
dir=$cache/slime-${commit:0:7}-$hash
build() {
  [ -f "$dir/.done" ] && return
  local python=${PYTHON:-$root/.venv/bin/python} tmp
  [ -x "$python" ] || python=python3
  say "building $dir (slime ${commit:0:7}, ${#packages[@]} packages)"
  tmp=$(mktemp -d "$dir.tmp.XXXXXX")
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --target "$tmp/site" "${packages[@]}" >&2
  cp -r "$vendored/slime" "$tmp/site/slime"
  cp -r "$stubs/." "$tmp/site/"
  find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
  touch "$tmp/.done"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  say "built $dir ($(du -sh "$dir" | cut -f1))"
}
if [ ! -f "$dir/.done" ]; then
  mkdir -p "$cache"
  # One build at a time per directory (parallel test runs call this too).
  exec 9>"$dir.lock"
  flock 9
  build
  exec 9>&-
fi
echo "$dir/site"
