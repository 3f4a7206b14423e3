#!/usr/bin/env bash
# Builds (once, cached) what the lent H200 needs to run the REAL SGLang 0.5.17 whole (it has no network), and
# puts it into .device/sglang-gpu/ for the device tool to carry (.git/info/exclude keeps .device/ out of git):
#
#   bash scripts/sglang-gpu-carry.sh          # here; then, on the H200:
#   device run, carry [".device/sglang-gpu"], command "bash bench/colocated_device.sh sglang-gpu check"
#
# What it holds (the study: ../shared/research/sglang-gpu.md; packed, about 50 MB):
# - sglang 0.5.17 (the newest release that pins torch 2.11.0, the device's own cu130 build): the wheel's files,
#   as tar.xz;
# - sglang-kernel 0.4.5 (0.5.17's pin, imported as `sgl_kernel`) cut to its Python files, the Hopper ops
#   library `sm90/common_ops.abi3.so`, `spatial_ops.abi3.so` and `triton_kernels/`, as tar.xz: its 1.1 GB FA3
#   library (`flash_ops`) serves only the FA3 attention backend, which we do not use (`--attention-backend
#   triton`); FlashMLA, infllm and the sm100 build serve other models and GPUs;
# - the light wheels SGLang 0.5.17 imports that the device lacks, torch_memory_saver 0.0.10 (ctypes, CUDA 12
#   and 13 variants) and transformers 5.12.1 / tokenizers 0.22.2 (the device's transformers 5.17 breaks
#   SGLang 0.5.17's import: "'qwen3_asr' is already used by a Transformers config").
# Redis (the server with its libraries, redis-py, hiredis) is packed from .device/colocated. flashinfer is not carried: a stub stands in
# for it (tests/sglang_gpu/stubs/sitecustomize.py says which modules and why).
#
# The cache lives in ${COLOCATE_CACHE_DIR:-~/.cache/colocate-operator}/sglang-gpu-0.5.17-HASH (HASH covers
# this script); a second call only copies it. The only stdout line is the carry folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
say() { printf '[sglang-gpu-carry] %s\n' "$*" >&2; }

SGLANG=0.5.17
KERNEL=0.4.5
wheels=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.11 blobfile==3.3.0 cffi==2.1.1 compressed-tensors==0.18.0
  dill==0.4.1 distro==1.9.0 fastapi==0.165.0 gguf==0.19.0 importlib-metadata==10.2.0 interegular==0.3.3
  jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 msgspec==0.23.0
  openai==2.8.0 opentelemetry-api==1.45.2 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0
  rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1 starlette==1.10.0
  tokenizers==0.22.2 torch-memory-saver==0.0.10 transformers==5.12.1 typing-inspection==0.4.5
  uvicorn==0.54.0 xgrammar==0.2.7
)
# The device: x86-64, CPython 3.12, glibc new enough for every manylinux tag below.
platforms=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done

hash=$(sha256sum "$0" | cut -c1-12)
cache=${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}
dir=$cache/sglang-gpu-$SGLANG-$hash
out=$root/.device/sglang-gpu

build() {
  local python=${PYTHON:-$root/.venv/bin/python} tmp
  [ -x "$python" ] || python=python3
  tmp=$(mktemp -d "$dir.tmp.XXXXXX")
  say "downloading sglang $SGLANG, sglang-kernel $KERNEL and ${#wheels[@]} wheels into $tmp"
  local pip=("$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp "${platforms[@]}" --platform any)
  "${pip[@]}" -d "$tmp/big" "sglang==$SGLANG" "sglang-kernel==$KERNEL" >&2
  "${pip[@]}" -d "$tmp/wheels" "${wheels[@]}" >&2
  # Installed here (pure unpacking: --no-deps, binary wheels only) and packed: xz takes a third off the wheels'
  # zip, and the device only unpacks.
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" --platform any --target "$tmp/unpack/site" \
    "$tmp"/wheels/*.whl >&2
  find "$tmp/unpack/site" -name __pycache__ -prune -exec rm -rf {} +
  rm -rf "$tmp/unpack/site/bin"
  tar -C "$tmp/unpack/site" -cJf "$tmp/site.tar.xz" .
  mkdir -p "$tmp/unpack/sglang" "$tmp/unpack/kernel"
  (cd "$tmp/unpack/sglang" && "$python" -m zipfile -e "$tmp"/big/sglang-"$SGLANG"-*.whl .)
  find "$tmp/unpack/sglang" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$tmp/unpack/sglang" -cJf "$tmp/sglang-$SGLANG.tar.xz" .
  (cd "$tmp/unpack/kernel" && "$python" -m zipfile -e "$tmp"/big/sglang_kernel-"$KERNEL"-*.whl .)
  (
    cd "$tmp/unpack/kernel"
    # Python files, the Hopper ops library and the small spatial one; triton_kernels; the dist-info.
    find sgl_kernel -name '*.py' >"$tmp/kernel.list"
    printf '%s\n' sgl_kernel/sm90/common_ops.abi3.so sgl_kernel/spatial_ops.abi3.so >>"$tmp/kernel.list"
    find triton_kernels sglang_kernel-"$KERNEL".dist-info -type f -not -path '*/__pycache__/*' >>"$tmp/kernel.list"
    tar -cJf "$tmp/sglang_kernel-$KERNEL-sm90.tar.xz" -T "$tmp/kernel.list"
  )
  rm -rf "$tmp/big" "$tmp/unpack" "$tmp/wheels" "$tmp/kernel.list"
  touch "$tmp/.done"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  say "built $dir ($(du -sh "$dir" | cut -f1))"
}

if [ ! -f "$dir/.done" ]; then
  mkdir -p "$cache"
  exec 9>"$dir.lock"
  flock 9
  [ -f "$dir/.done" ] || build
  exec 9>&-
fi
grep -qx '/.device/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device/' >>"$root/.git/info/exclude"
rm -rf "$out"
mkdir -p "$out"
cp -r "$dir/." "$out/"
rm -f "$out/.done"
# Redis (server, its libraries, redis-py, hiredis) as `bench/colocated_device.sh prepare` gathers it, packed:
# 13 MB as files, 4 MB as tar.xz; the verb unpacks it where that script's `setup_device` looks.
[ -d "$root/.device/colocated" ] || bash "$root/bench/colocated_device.sh" prepare >&2
tar -C "$root/.device" -cJf "$out/colocated.tar.xz" colocated
say "carry: $out ($(du -sh "$out" | cut -f1))"
echo "$out"
