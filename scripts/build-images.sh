#!/usr/bin/env bash
# Builds the project's container images on this machine, with no image registry: a Debian base made from
# Debian's packages with mmdebstrap (python3.11 of the pinned suite), imported as an image; a pause image for
# the real node's pod sandboxes (Kubernetes' own pause.c, from the kubernetes module the control plane is
# built from); the operator image from the repository's Dockerfile on top of that base
# (--build-arg BASE_IMAGE/BASE_TAG; the Dockerfile's default stays the public base pinned by digest); the
# meta-store's Redis (images/redis/Dockerfile: Debian's redis-server on the same base); and the worker
# containers' runtime image (images/runtime/Dockerfile: this package with torch on the CPU, the SGLang
# stand-in and the demo's trainer) on a second base made by mmdebstrap from Debian trixie, whose python3-torch
# (2.6, CPU only) stands in for PyTorch's CPU wheels: download.pytorch.org is not reachable here, and PyPI's
# torch for Linux is the CUDA build (about 4 GB with its NVIDIA libraries).
#
# Each image is skipped when its inputs did not change (a label on the image holds their hash). Beside the
# images, docker-archive tarballs that the real node's containerd imports (`ctr -n k8s.io images import`)
# go to $COLOCATE_CACHE_DIR/images (default ~/.cache/colocate-operator/images), listed in images.txt as
# "<reference> <archive>" lines. Prints that directory as its last line.
#
#   COLOCATE_CACHE_DIR   cache root (default: ~/.cache/colocate-operator)
#   DEBIAN_MIRROR        Debian mirror for mmdebstrap (default: http://deb.debian.org/debian)
#
# Needs root (mmdebstrap, buildah and podman as root), and installs Debian's mmdebstrap, buildah and podman
# when they are absent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { printf '[build-images] %s\n' "$*" >&2; }
started=$SECONDS

suite=bookworm  # the pinned Debian suite: python3 is 3.11 there
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base_packages=python3,python3-venv,python-is-python3,ca-certificates
# The runtime's base: Debian trixie, whose python3-torch is 2.6 on the CPU (bookworm's is 1.13).
runtime_suite=trixie
runtime_packages=python3,python3-venv,python-is-python3,python3-torch,passwd,ca-certificates
version=$(grep -E '^appVersion:' charts/colocate-operator/Chart.yaml | grep -oE '[0-9][^"]*' | head -1)
operator_ref=localhost/colocate-operator:$version
runtime_ref=localhost/colocate-runtime:$version
redis_ref=localhost/colocate-redis:7.0-bookworm
pause_ref=localhost/pause:colocate
out="${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}/images"

[ "$(id -u)" -eq 0 ] || { log "needs root (mmdebstrap, buildah and podman run as root here)"; exit 1; }
missing=()
for tool in mmdebstrap buildah podman gcc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mkdir -p "$out"
exec 9>"$out/.lock"
flock -n 9 || { log "another build-images.sh is running; waiting for it"; flock 9; }

# Containers started by buildah's RUN steps get runc's default rlimits (1048576 open files) unless told
# otherwise, and raising a hard limit needs CAP_SYS_RESOURCE, which a sandboxed root (this VM) may lack.
ulimits=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)
# A machine behind a TLS-inspecting proxy trusts it through its own CA bundle: the RUN steps see the host's
# bundle (bind-mounted, not copied: nothing of this machine ends up in an image).
ca_mount=()
[ -s /etc/ssl/certs/ca-certificates.crt ] \
  && ca_mount=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

label() { podman image inspect --format '{{ index .Labels "dev.colocate.inputs" }}' "$1" 2>/dev/null || true; }
save() {  # save <ref> <archive name>: the archive the node's containerd imports
  local tmp="$out/$2.tmp"
  rm -f "$tmp" && podman save --quiet --format docker-archive -o "$tmp" "$1" && mv "$tmp" "$out/$2"
}

# 1. The bases: Debian root filesystems from Debian's packages, imported as images.
make_base() {  # make_base <ref> <suite> <packages> [more mmdebstrap options...]
  local ref=$1 suite=$2 packages=$3 key=${1##*-} t=$SECONDS tar
  shift 3
  if podman image exists "$ref"; then log "base $ref cached"; return; fi
  log "making a base root filesystem: mmdebstrap $suite ($packages)"
  tar=$(mktemp -p "$out" base-XXXXXX.tar)
  # The path now, not at exit: `tar` is local, and unbound (set -u) once this function returned.
  trap "rm -f '$tar'" EXIT
  mmdebstrap --quiet --variant=minbase --include="$packages" "$@" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$suite" "$tar" "$mirror"
  podman import --quiet --change 'CMD ["python3"]' --change "LABEL dev.colocate.inputs=$key" \
    "$tar" "$ref" >/dev/null
  rm -f "$tar"
  trap - EXIT
  log "base $ref made in $((SECONDS - t)) s"
}
base_key=$(printf '%s\n' "$suite" "$base_packages" "v1" | sha256sum | cut -c1-12)
base_ref=localhost/colocate-base:$suite-py311-$base_key
make_base "$base_ref" "$suite" "$base_packages"
# Without recommends: python3-torch's would add compilers and MPI's tools.
runtime_base_key=$(printf '%s\n' "$runtime_suite" "$runtime_packages" "no-recommends" "v1" | sha256sum | cut -c1-12)
runtime_base_ref=localhost/colocate-base:$runtime_suite-torch-$runtime_base_key
# COLOCATE_RUNTIME_IMAGE=0 leaves out the worker image (1.3 GB; only tests/realnode/test_realnode_job.py, in the
# slow set, runs it): `make test` then builds and imports the other images alone.
with_runtime=${COLOCATE_RUNTIME_IMAGE:-1}
[ "$with_runtime" = 0 ] || make_base "$runtime_base_ref" "$runtime_suite" "$runtime_packages" \
  --aptopt='Apt::Install-Recommends "false"'

# 2. The pause image: the sandbox every pod's network namespace hangs on (containerd's sandbox_image).
pause_src=$(cd tools/k8s && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
pause_key=$(cat "$pause_src" | sha256sum | cut -c1-12)
if [ "$(label "$pause_ref")" = "$pause_key" ] && [ -s "$out/pause.tar" ]; then
  log "pause $pause_ref cached"
else
  t=$SECONDS
  work=$(mktemp -d)
  gcc -Os -static -DVERSION=colocate -o "$work/pause" "$pause_src" && strip "$work/pause"
  ctr=$(buildah from --quiet scratch)
  buildah copy --quiet "$ctr" "$work/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 --label "dev.colocate.inputs=$pause_key" "$ctr"
  buildah commit --quiet --rm "$ctr" "$pause_ref" >/dev/null
  rm -rf "$work"
  save "$pause_ref" pause.tar
  log "pause $pause_ref built in $((SECONDS - t)) s"
fi

# 3. The images built from Dockerfiles on those bases. Their inputs: the Dockerfile, the base, and the files
# their COPY lines take (tracked or not, as git sees them).
build_image() {  # build_image <ref> <archive> <Dockerfile> <context> <base ref> <layers> <input paths...>
  local ref=$1 archive=$2 dockerfile=$3 context=$4 base=$5 layers=$6 key t=$SECONDS
  shift 6
  key=$(
    {
      echo "$base"
      sha256sum "$dockerfile"
      [ $# -eq 0 ] || git ls-files -co --exclude-standard -- "$@" | LC_ALL=C sort | xargs -r -d '\n' sha256sum
    } | sha256sum | cut -c1-12
  )
  if [ "$(label "$ref")" = "$key" ] && [ -s "$out/$archive" ]; then log "$ref cached"; return; fi
  log "building $ref from $dockerfile on $base"
  buildah bud --quiet --layers="$layers" --network host "${ulimits[@]}" "${ca_mount[@]}" \
    --build-arg "BASE_IMAGE=${base%:*}" --build-arg "BASE_TAG=${base##*:}" --label "dev.colocate.inputs=$key" \
    -t "$ref" -f "$dockerfile" "$context" >/dev/null
  save "$ref" "$archive"
  log "$ref built in $((SECONDS - t)) s"
}
# README.md is copied for the package's metadata (pyproject's readme) only: its edits rebuild nothing.
sources=(pyproject.toml operator runtime devcluster)
build_image "$operator_ref" colocate-operator.tar Dockerfile . "$base_ref" false "${sources[@]}"
build_image "$redis_ref" colocate-redis.tar images/redis/Dockerfile images/redis "$base_ref" false
# The runtime image with buildah's layer cache: its dependencies' layer (torch's base, pip) is reused until
# pyproject.toml changes; a source change rebuilds the last layers only.
[ "$with_runtime" = 0 ] || build_image "$runtime_ref" colocate-runtime.tar images/runtime/Dockerfile . \
  "$runtime_base_ref" true "${sources[@]}" demo/trainer.py

# Each image must start, as the non-root user it runs as.
check() {  # check <what> <ref> <command...>
  local what=$1 ref=$2
  shift 2
  podman run --rm --network none "${ulimits[@]}" "$ref" "$@" >/dev/null \
    || { log "the image $ref does not start: podman run $ref $* failed ($what)"; exit 1; }
}
check "the operator's --help" "$operator_ref" --help
check "redis-server --version" "$redis_ref" redis-server --version
[ "$with_runtime" = 0 ] || check "the runtime's imports" "$runtime_ref" python -c \
  "import os, torch, colocate_runtime.sglang.standin; assert os.getuid() == 10001 and not torch.cuda.is_available()"
podman image prune -f >/dev/null 2>&1 || true  # older untagged builds

built=("$base_ref" "$pause_ref" "$operator_ref" "$redis_ref")
printf '%s %s\n' "$pause_ref" pause.tar "$operator_ref" colocate-operator.tar "$redis_ref" colocate-redis.tar \
  > "$out/images.txt"
if [ "$with_runtime" != 0 ]; then
  printf '%s %s\n' "$runtime_ref" colocate-runtime.tar >> "$out/images.txt"
  built+=("$runtime_base_ref" "$runtime_ref")
fi
for ref in "${built[@]}"; do
  log "$(podman image inspect --format "$ref {{.Size}}" "$ref" | awk '{printf "%s %.0f MB", $1, $2 / 1e6}')"
done
log "images ready in $((SECONDS - started)) s: $out"
echo "$out"
