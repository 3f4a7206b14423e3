#!/usr/bin/env bash
# Builds KubeRay's operator (the benchmark's point of comparison, see bench/scale) from its Go module, pinned
# in tools/kuberay/go.mod, and caches the binary outside the work tree next to the control-plane binaries.
# Its CRDs are not copied anywhere: bench/scale reads them from the module cache (config/crd/bases).
#
#   KUBERAY_BIN_DIR      use this directory holding a prebuilt `ray-operator` instead of building
#   COLOCATE_CACHE_DIR   cache root (default: ~/.cache/colocate-operator)
#
# Prints two lines last: the directory holding `ray-operator`, then the module directory holding the CRDs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
module=github.com/ray-project/kuberay/ray-operator
tools="$root/tools/kuberay"

log() { printf '[build-kuberay] %s\n' "$*" >&2; }

command -v go >/dev/null || { log "the Go toolchain is required (go >= 1.26)"; exit 1; }
version=$(grep -oE "$module v[0-9][^ ]*" "$tools/go.mod" | head -1 | cut -d' ' -f2)
[ -n "$version" ] || { log "no $module requirement in $tools/go.mod"; exit 1; }
export GOFLAGS=-mod=readonly
# The module source (for the CRDs); downloaded once, verified against tools/kuberay/go.sum.
module_dir=$(cd "$tools" && go list -m -f '{{.Dir}}' "$module")
if [ -z "$module_dir" ] || [ ! -d "$module_dir/config/crd/bases" ]; then
  log "downloading $module@$version"
  (cd "$tools" && go mod download "$module")
  module_dir=$(cd "$tools" && go list -m -f '{{.Dir}}' "$module")
fi

if [ -n "${KUBERAY_BIN_DIR:-}" ]; then
  [ -x "$KUBERAY_BIN_DIR/ray-operator" ] || { log "KUBERAY_BIN_DIR=$KUBERAY_BIN_DIR has no ray-operator"; exit 1; }
  echo "$KUBERAY_BIN_DIR"; echo "$module_dir"; exit 0
fi

key=$(cat "$tools/go.mod" "$tools/go.sum" | sha256sum | cut -c1-12)
out="${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}/kuberay-$version-$key"
if [ -x "$out/ray-operator" ]; then
  log "KubeRay operator $version cached in $out"
  echo "$out"; echo "$module_dir"; exit 0
fi

mkdir -p "$out.tmp"
start=$SECONDS
log "building KubeRay operator $version from $module (a few minutes on 2 cores; the Go build cache it"
log "shares with the Kubernetes build makes later builds quicker)"
(cd "$tools" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/ray-operator" "$module")
rm -rf "$out" && mv "$out.tmp" "$out"
log "built in $((SECONDS - start)) s: $out/ray-operator"
echo "$out"
echo "$module_dir"
