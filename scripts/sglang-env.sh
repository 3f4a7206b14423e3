#!/usr/bin/env bash
# Builds (once) an import path in which the REAL SGLang runs on a CPU-only machine, next to the torch and
# transformers of the project's .venv:
#
#   PYTHONPATH=$(bash scripts/sglang-env.sh 0.5.10) CUDA_VISIBLE_DEVICES= .venv/bin/python -m sglang.launch_server ...
#
# It `pip install --no-deps --target`s sglang==VERSION plus the light packages SGLang really imports (pinned
# below, so builds repeat), and copies in the stand-ins of tests/sglang_real/shims/ for what cannot be installed
# on CPU. The result lives in ${COLOCATE_CACHE_DIR:-~/.cache/colocate-operator}/sglang-VERSION-HASH, HASH
# covering this script and the shims; a second call only prints the path. The only stdout line is the
# PYTHONPATH to use; progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=${1:?usage: sglang-env.sh VERSION (0.5.10, 0.5.17 or 0.5.23)}
say() { printf '[sglang-env] %s\n' "$*" >&2; }

# Pure-Python or manylinux wheels only (no compilers, no CUDA). Shared by both versions.
common=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 anyio==4.16.0 attrs==26.1.0
  blobfile==3.3.0 cffi==2.1.1 compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 einops==0.8.2 fastapi==0.165.0
  frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 importlib-metadata==10.2.0
  interegular==0.3.3 jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3
  msgspec==0.23.0 multidict==7.2.1 openai==2.8.0 opentelemetry-api==1.45.2 orjson==3.13.0
  partial-json-parser==0.2.1.1.post7 prometheus-client==0.26.0 propcache==0.5.4 psutil==7.2.2
  pybase64==1.5.1 python-multipart==0.0.34 pyyaml==6.0.4 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1
  sentencepiece==0.2.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1 starlette==1.10.0 typing-inspection==0.4.5
  uvicorn==0.54.0 uvloop==0.23.0 xxhash==4.1.0 yarl==1.25.1 zipp==4.1.2
)
case "$version" in
  0.5.10) extra=(sglang==0.5.10 xgrammar==0.1.32) ;;
  # 0.5.17 registers a `qwen3_asr` config that transformers >= 5.13 already has: its own pin, 5.12.1
  0.5.17) extra=(sglang==0.5.17 apache-tvm-ffi==0.1.11 xgrammar==0.2.7 transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0) ;;
  0.5.23) extra=(sglang==0.5.23 apache-tvm-ffi==0.1.11 xgrammar==0.2.7) ;;
  *) say "unsupported version $version (pinned: 0.5.10, 0.5.23; 0.5.17 for the slow set)"; exit 2 ;;
esac

shims=$root/tests/sglang_real/shims
hash=$( { cat "$0"; find "$shims" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs cat; } \
  | sha256sum | cut -c1-12)
cache=${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}
dir=$cache/sglang-$version-$hash
build() {
  [ -f "$dir/.done" ] && return
  local python=${PYTHON:-$root/.venv/bin/python} tmp
  [ -x "$python" ] || python=python3
  say "building $dir (sglang $version, ${#common[@]}+${#extra[@]} packages)"
  tmp=$(mktemp -d "$dir.tmp.XXXXXX")
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --target "$tmp/site" "${common[@]}" "${extra[@]}" >&2
  mkdir -p "$tmp/shims"
  cp -r "$shims/common/." "$tmp/shims/"
  # 0.5.17's kernel imports are 0.5.23's: it takes that version's stand-ins.
  local shim_version=$version
  [ "$version" != 0.5.17 ] || shim_version=0.5.23
  if [ -d "$shims/$shim_version" ]; then cp -r "$shims/$shim_version/." "$tmp/shims/"; fi
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
echo "$dir/site:$dir/shims"
