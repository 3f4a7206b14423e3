#!/usr/bin/env bash
# Builds the local control-plane binaries from the Go tools modules in tools/ and caches them outside the
# work tree, keyed by the tools modules' content (versions live in their go.mod files).
#
#   COLOCATE_BIN_DIR     use this directory of prebuilt binaries instead of building (nothing is built)
#   COLOCATE_CACHE_DIR   cache root (default: ~/.cache/colocate-operator)
#
# Kueue (tools/kueue) is built into a directory of its own, kueue-<version>-<key>, keyed by its module alone,
# so a Kueue bump never rebuilds Kubernetes and the Kubernetes key stays what it was. Beside its binary go
# the CRDs and webhook manifests of its module; devcluster/kueue.py starts it (tests that ask for it only).
#
# Prints the directory holding the binaries as its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm kubelet)
# kubelet runs only on the real node (devcluster/realnode.py): a prebuilt COLOCATE_BIN_DIR may lack it.
optional=(kubelet)
# kwok needs stage definitions (how fake nodes and pods move through their lifecycle); we take the ones its
# module ships and keep them beside the binaries.
kwok_stages=(node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml)

log() { printf '[build-tools] %s\n' "$*" >&2; }

if [ -n "${COLOCATE_BIN_DIR:-}" ]; then
  for b in "${binaries[@]}" kwok-stages.yaml; do
    [[ " ${optional[*]} " == *" $b "* ]] && continue
    [ -e "$COLOCATE_BIN_DIR/$b" ] || { log "COLOCATE_BIN_DIR=$COLOCATE_BIN_DIR has no '$b'"; exit 1; }
  done
  echo "$COLOCATE_BIN_DIR"; exit 0
fi

command -v go >/dev/null || { log "the Go toolchain is required (go >= 1.26): https://go.dev/doc/install"; exit 1; }
kube_version=$(grep -oE 'k8s\.io/kubernetes v[0-9.]+' "$root/tools/k8s/go.mod" | head -1 | cut -d' ' -f2)
key=$(cat "$root"/tools/{k8s,etcd,kwok,helm}/go.{mod,sum} | sha256sum | cut -c1-12)
out="${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}/bin-$kube_version-$key"

export CGO_ENABLED=0 GOFLAGS=-mod=readonly

# One build at a time: `make setup` and a test run started beside it would otherwise both write the same
# temporary directories. A second caller waits, then finds the cache filled.
cache_root="${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}"
mkdir -p "$cache_root"
exec 9>"$cache_root/build-tools.lock"
flock -n 9 || { log "another build-tools.sh is building; waiting for it"; flock 9; }

# Kueue: its own cache directory (what it holds is listed in kueue_files), filled in a temporary one first so
# an interrupted build never looks complete.
kueue_module=sigs.k8s.io/kueue
kueue_version=$(grep -oE "$kueue_module v[0-9][^ ]*" "$root/tools/kueue/go.mod" | head -1 | cut -d' ' -f2)
kueue_key=$(cat "$root"/tools/kueue/go.{mod,sum} | sha256sum | cut -c1-12)
kueue_out="${COLOCATE_CACHE_DIR:-$HOME/.cache/colocate-operator}/kueue-$kueue_version-$kueue_key"
if [ -x "$kueue_out/kueue" ] && [ -s "$kueue_out/webhooks.yaml" ] && [ -d "$kueue_out/crds" ]; then
  log "Kueue $kueue_version cached in $kueue_out"
else
  kueue_start=$SECONDS
  log "building Kueue $kueue_version from $kueue_module (10-25 minutes on 2 cores; 25 min measured under load)"
  rm -rf "$kueue_out.tmp" && mkdir -p "$kueue_out.tmp/crds"
  (cd "$root/tools/kueue" && go build -trimpath \
    -ldflags "-s -w -X $kueue_module/pkg/version.GitVersion=$kueue_version" \
    -o "$kueue_out.tmp/kueue" "$kueue_module/cmd/kueue")
  kueue_dir=$(cd "$root/tools/kueue" && go list -m -f '{{.Dir}}' "$kueue_module")
  cp "$kueue_dir"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$kueue_out.tmp/crds/"
  cp "$kueue_dir/config/components/webhook/manifests.yaml" "$kueue_out.tmp/webhooks.yaml"
  chmod -R u+w "$kueue_out.tmp"  # the module cache is read-only; the copies need not be
  rm -rf "$kueue_out" && mv "$kueue_out.tmp" "$kueue_out"
  log "built Kueue in $((SECONDS - kueue_start)) s: $kueue_out"
fi

# The fake GPU driver of the real node (devcluster/fakegpu: a device plugin the kubelet talks to, a stand-in
# for NVIDIA's), a module of this repository: its own cache directory, keyed by its sources. Seconds to build
# once the Kubernetes modules are in Go's cache (it needs grpc and k8s.io/kubelet's API packages only).
fakegpu_src="$root/devcluster/fakegpu"
fakegpu_key=$(cat "$fakegpu_src"/go.mod "$fakegpu_src"/go.sum "$fakegpu_src"/*.go | sha256sum | cut -c1-12)
fakegpu_out="$cache_root/fakegpu-$fakegpu_key"
if [ -x "$fakegpu_out/colocate-fakegpu" ]; then
  log "fake GPU device plugin cached in $fakegpu_out"
else
  fakegpu_start=$SECONDS
  rm -rf "$fakegpu_out.tmp" && mkdir -p "$fakegpu_out.tmp"
  (cd "$fakegpu_src" && go build -trimpath -ldflags "-s -w" -o "$fakegpu_out.tmp/colocate-fakegpu" .)
  rm -rf "$fakegpu_out" && mv "$fakegpu_out.tmp" "$fakegpu_out"
  log "built the fake GPU device plugin in $((SECONDS - fakegpu_start)) s: $fakegpu_out"
fi

missing=()
for b in "${binaries[@]}"; do [ -x "$out/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ] && [ -s "$out/kwok-stages.yaml" ]; then log "control-plane binaries cached in $out"; echo "$out"; exit 0; fi

mkdir -p "$out"
build() {  # build <module dir> <packages...>; one call per module shares its build cache
  local dir=$1; shift
  local start=$SECONDS
  log "building $*"
  (cd "$dir" && go build -trimpath -ldflags "${ldflags:-}" -o "$out/" "$@")
  log "built $(basename "$dir") in $((SECONDS - start)) s"
}

need() { local b; for b in "$@"; do [[ " ${missing[*]} " == *" $b "* ]] && return 0; done; return 1; }

if need etcd; then  # the etcd server's main package is named after its directory, "server"
  ldflags="-s -w" build "$root/tools/etcd" go.etcd.io/etcd/server/v3 && mv "$out/server" "$out/etcd"
fi
if need kwok; then ldflags="-s -w" build "$root/tools/kwok" sigs.k8s.io/kwok/cmd/kwok; fi
if [ ! -s "$out/kwok-stages.yaml" ]; then
  kwok_dir=$(cd "$root/tools/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  for f in "${kwok_stages[@]}"; do cat "$kwok_dir/kustomize/stage/$f"; echo "---"; done > "$out/kwok-stages.yaml.tmp"
  mv "$out/kwok-stages.yaml.tmp" "$out/kwok-stages.yaml"
fi
if need helm; then ldflags="-s -w" build "$root/tools/helm" helm.sh/helm/v4/cmd/helm; fi
if need kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; then
  minor=$(echo "$kube_version" | cut -d. -f2)
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$kube_version -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "Kubernetes $kube_version from source: about 7-25 minutes on 2 cores"
  build "$root/tools/k8s" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet
fi

for b in "${binaries[@]}"; do [ -x "$out/$b" ] || { log "build finished but '$b' is missing in $out"; exit 1; }; done
log "control-plane binaries ready in $out"
echo "$out"
