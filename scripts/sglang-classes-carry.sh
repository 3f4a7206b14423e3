#!/usr/bin/env bash
# Builds (once, cached) what the lent H200 needs to build SGLang 0.5.10's and 0.5.23's own model classes on CUDA
# (bench/sglang_gpu_classes.py; these two versions cannot run whole there), and puts it into
# .device/sglang-classes/ for the device tool to carry (.git/info/exclude keeps .device/ out of git):
#
#   bash scripts/sglang-classes-carry.sh      # here; then, on the H200:
#   device run, carry [".device/sglang-classes"], command "bash bench/colocated_device.sh sglang-classes"
#
# What it holds (about 25 MB; one device call carries at most 64 MiB):
# - sglang 0.5.10 and 0.5.23: the wheels' files (as the CPU tier's envs of scripts/sglang-env.sh unpacked them)
#   but sglang/multimodal_gen, sglang/test and the compiled extensions (rust_extensions, the radix tree core:
#   cp311 builds there, and not imported to build a model); the JIT kernel sources stay (0.5.23 looks for
#   sglang/kernels/jit at import); tar.xz each;
# - light cp312 wheels, unpacked and packed as one tar.xz: the union of what the CPU tier installs for both
#   versions and what the 0.5.17 GPU tier carries, torch_memory_saver 0.0.10 (ctypes; CUDA 12 and 13 hook
#   libraries) included; not transformers or tokenizers (the device's transformers 5.17 is tried first);
# - transformers 5.12.1 with tokenizers 0.22.2 apart (tar.xz), put first on the path only where a version does
#   not import with the device's transformers (5.17 broke 0.5.17's import);
# - Redis, packed from .device/colocated (bench/colocated_device.sh prepare).
# No kernel package and no flashinfer: tests/sglang_gpu/classes_stubs/sitecustomize.py stands in (it says why).
#
# The cache lives in ${COLOCATE_CACHE_DIR:-~/.cache/colocate-operator}/sglang-classes-HASH (HASH covers this
# script); a second call only copies it. The only stdout line is the carry folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
say() { printf '[sglang-classes-carry] %s\n' "$*" >&2; }

VERSIONS=(0.5.10 0.5.23)
wheels=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
  anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 blobfile==3.3.0 cffi==2.1.1 compressed-tensors==0.18.0
  dill==0.4.1 distro==1.9.0 einops==0.8.2 fastapi==0.165.0 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0
  hiredis==3.5.0 httpcore==1.0.9 httpx==0.28.1 importlib-metadata==10.2.0 interegular==0.3.3 jiter==0.19.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1
  openai==2.8.0 opentelemetry-api==1.45.2 orjson==3.13.0 partial-json-parser==0.2.1.1.post7
  prometheus-client==0.26.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4
  pydantic-core==2.50.5 python-multipart==0.0.34 pyyaml==6.0.4 pyzmq==27.3.0 redis==8.1.0 referencing==0.37.0
  rpds-py==2026.9.1 sentencepiece==0.2.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1
  starlette==1.10.0 torch-memory-saver==0.0.10 typing-inspection==0.4.5 uvicorn==0.54.0 uvloop==0.23.0
  xgrammar==0.2.7 xxhash==4.1.0 yarl==1.25.1 zipp==4.1.2
)
fallback=(transformers==5.12.1 tokenizers==0.22.2)
# The device: x86-64, CPython 3.12, glibc new enough for every manylinux tag below.
platforms=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done

hash=$(sha256sum "$0" | cut -c1-12)
cache=${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}
dir=$cache/sglang-classes-$hash
out=$root/.device/sglang-classes

unpack_and_pack() {  # PYTHON WHEEL_DIR TARBALL
  local python=$1 from=$2 tarball=$3 into
  into=$(mktemp -d)
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" --platform any --target "$into" "$from"/*.whl >&2
  find "$into" -name __pycache__ -prune -exec rm -rf {} +
  rm -rf "$into/bin"
  tar -C "$into" -cJf "$tarball" .
  rm -rf "$into"
}

build() {
  local python=${PYTHON:-$root/.venv/bin/python} tmp=$dir.staging v site
  [ -x "$python" ] || python=python3
  mkdir -p "$tmp"  # each piece is kept once made: an interrupted build goes on where it stopped
  local pip=("$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp "${platforms[@]}" --platform any)
  if [ ! -f "$tmp/site.tar.xz" ]; then
    say "downloading ${#wheels[@]} cp312 wheels into $tmp"
    "${pip[@]}" -d "$tmp/wheels" "${wheels[@]}" >&2
    unpack_and_pack "$python" "$tmp/wheels" "$tmp/site.tar.xz.part" && mv "$tmp/site.tar.xz.part" "$tmp/site.tar.xz"
  fi
  if [ ! -f "$tmp/transformers-5.12.1.tar.xz" ]; then
    "${pip[@]}" -d "$tmp/fallback" "${fallback[@]}" >&2
    unpack_and_pack "$python" "$tmp/fallback" "$tmp/tf.part" && mv "$tmp/tf.part" "$tmp/transformers-5.12.1.tar.xz"
  fi
  for v in "${VERSIONS[@]}"; do
    [ -f "$tmp/sglang-$v.tar.xz" ] && continue
    # The CPU tier's env holds the wheel's files as pip unpacked them (its Python files: the same for cp312).
    site=$(bash "$root/scripts/sglang-env.sh" "$v" | cut -d: -f1)
    say "packing sglang $v from $site"
    (cd "$site" && find sglang -type f -not -name '*.so' -not -path 'sglang/multimodal_gen/*' \
      -not -path 'sglang/test/*' -not -path '*/__pycache__/*' \
      | XZ_OPT=-T0 tar -cJf "$tmp/sglang-$v.part" -T - "sglang-$v.dist-info")
    mv "$tmp/sglang-$v.part" "$tmp/sglang-$v.tar.xz"
  done
  rm -rf "$tmp/wheels" "$tmp/fallback"
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
# Redis (server, its libraries, the redis-py wheel) as `bench/colocated_device.sh prepare` gathers it, packed.
[ -d "$root/.device/colocated" ] || bash "$root/bench/colocated_device.sh" prepare >&2
tar -C "$root/.device" -cJf "$out/colocated.tar.xz" colocated
say "carry: $out ($(du -sh "$out" | cut -f1))"
echo "$out"
