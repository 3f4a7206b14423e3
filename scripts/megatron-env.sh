#!/usr/bin/env bash
# Builds (once) an import path holding a REAL megatron-core release from PyPI, next to the torch of the
# project's .venv (tests/megatron_real builds Megatron's GPTModel on CPU with its local layer specs):
#
#   PYTHONPATH=$(bash scripts/megatron-env.sh 0.16.1) .venv/bin/python -c 'import megatron.core'
#
# `pip install --no-deps --target`: megatron-core's own requirements (torch, numpy, packaging) are the venv's;
# Transformer-Engine and Apex are not installed (they need CUDA to build). The result lives in
# ${COLOCATE_CACHE_DIR:-~/.cache/colocate-operator}/megatron-core-VERSION-HASH, HASH covering this script; a
# second call only prints the path. The only stdout line is the PYTHONPATH to use; progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=${1:?usage: megatron-env.sh VERSION (0.13.1, 0.14.0 or 0.16.1)}
say() { printf '[megatron-env] %s\n' "$*" >&2; }

# The releases the tests run (0.14.0: the Transformer-Engine spec's MLA down projections became duplicated).
case "$version" in
  0.13.1 | 0.14.0 | 0.16.1) ;;
  *) say "unsupported version $version (pinned: 0.13.1, 0.14.0, 0.16.1)"; exit 2 ;;
esac

hash=$(sha256sum "$0" | cut -c1-12)
cache=${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}
dir=$cache/megatron-core-$version-$hash
build() {
  [ -f "$dir/.done" ] && return
  local python=${PYTHON:-$root/.venv/bin/python} tmp
  [ -x "$python" ] || python=python3
  say "building $dir (megatron-core $version)"
  tmp=$(mktemp -d "$dir.tmp.XXXXXX")
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --target "$tmp/site" "megatron-core==$version" >&2
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
