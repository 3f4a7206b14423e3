#!/usr/bin/env bash
# Builds the project's container images on this machine, with no image registry: a Debian base made from
# Debian's packages with mmdebstrap (python3.11 of the pinned suite), imported as an image; a pause image for
# the real node's pod sandboxes (Kubernetes' own pause.c, from the kubernetes module the control plane is
# built from); and the operator image from the repository's Dockerfile on top of that base
# (--build-arg BASE_IMAGE/BASE_TAG; the Dockerfile's default stays the public base pinned by digest).
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
version=$(grep -E '^appVersion:' charts/colocate-operator/Chart.yaml | grep -oE '[0-9][^"]*' | head -1)
operator_ref=localhost/colocate-operator:$version
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

# 1. The base: a Debian root filesystem from Debian's packages, imported as an image.
base_key=$(printf '%s\n' "$suite" "$base_packages" "v1" | sha256sum | cut -c1-12)
base_ref=localhost/colocate-base:$suite-py311-$base_key
if podman image exists "$base_ref"; then
  log "base $base_ref cached"
else
  t=$SECONDS
  log "making the base root filesystem: mmdebstrap $suite ($base_packages)"
  tar=$(mktemp -p "$out" base-XXXXXX.tar)
  trap 'rm -f "$tar"' EXIT
  mmdebstrap --quiet --variant=minbase --include="$base_packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$suite" "$tar" "$mirror"
  podman import --quiet --change 'CMD ["python3"]' --change "LABEL dev.colocate.inputs=$base_key" \
    "$tar" "$base_ref" >/dev/null
  rm -f "$tar"
  log "base $base_ref made in $((SECONDS - t)) s"
fi

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

# 3. The operator image from the Dockerfile, on the base above. Its inputs: the Dockerfile, the base, and
# the files its COPY lines take (tracked or not, as git sees them).
inputs=(pyproject.toml README.md operator runtime devcluster)
operator_key=$(
  {
    echo "$base_ref"
    sha256sum Dockerfile
    git ls-files -co --exclude-standard -- "${inputs[@]}" | LC_ALL=C sort | xargs -d '\n' sha256sum
  } | sha256sum | cut -c1-12
)
if [ "$(label "$operator_ref")" = "$operator_key" ] && [ -s "$out/colocate-operator.tar" ]; then
  log "operator $operator_ref cached"
else
  t=$SECONDS
  log "building $operator_ref from the Dockerfile on $base_ref"
  buildah bud --quiet --layers=false --network host "${ulimits[@]}" "${ca_mount[@]}" \
    --build-arg "BASE_IMAGE=${base_ref%:*}" --build-arg "BASE_TAG=${base_ref##*:}" --label "dev.colocate.inputs=$operator_key" \
    -t "$operator_ref" -f Dockerfile . >/dev/null
  save "$operator_ref" colocate-operator.tar
  log "operator $operator_ref built in $((SECONDS - t)) s"
fi

# The image must start: its entry point's --help, as the non-root user it runs as.
podman run --rm --network none "${ulimits[@]}" "$operator_ref" --help >/dev/null \
  || { log "the image $operator_ref does not start: podman run $operator_ref --help failed"; exit 1; }
podman image prune -f >/dev/null 2>&1 || true  # older untagged builds

printf '%s %s\n' "$pause_ref" pause.tar "$operator_ref" colocate-operator.tar > "$out/images.txt"
for ref in "$base_ref" "$pause_ref" "$operator_ref"; do
  log "$(podman image inspect --format "$ref {{.Size}}" "$ref" | awk '{printf "%s %.0f MB", $1, $2 / 1e6}')"
done
log "images ready in $((SECONDS - started)) s: $out"
echo "$out"
