#!/usr/bin/env bash
# One idempotent entry point for a fresh machine: Debian packages, the Python virtual environment with the
# project and its test dependencies, and the local control-plane binaries built from Go modules.
# A second run takes seconds: every step is skipped when its result is already there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
step() { printf '[setup] %s\n' "$*" >&2; }
started=$SECONDS

# 1. Debian packages: a real Redis server for the meta-store tests, openssl for the cluster's certificates.
packages=()
command -v redis-server >/dev/null || packages+=(redis-server)
command -v openssl >/dev/null || packages+=(openssl)
# The real node (devcluster/realnode.py) and the images it runs (scripts/build-images.sh): only as root, where
# they can run at all; elsewhere the real-node tests skip and say why.
if [ "$(id -u)" -eq 0 ]; then
  for tool in containerd runc iptables mmdebstrap buildah podman; do
    command -v "$tool" >/dev/null || packages+=("$tool")
  done
  [ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || packages+=(containernetworking-plugins)
fi
if [ ${#packages[@]} -gt 0 ]; then
  step "installing Debian packages: ${packages[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

# 2. The virtual environment, reinstalled when pyproject.toml changes.
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { step "Python >= 3.11 is required ($python is $("$python" --version 2>&1))"; exit 1; }
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  # torch with its CUDA libraries unpacks to about 7 GB beside pip's cache of the wheels; say so plainly
  # instead of letting pip fail half way with "No space left on device".
  need_gb=10
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    step "only $free_gb GB free on $(df -P . | awk 'NR == 2 {print $6}'); the virtual environment needs about $need_gb GB"
    step "(clean clones of this repository with their own .venv are the usual culprit)"
    exit 1
  fi
  step "creating .venv and installing colocate-operator[dev] (first run downloads torch: a few GB)"
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --progress-bar off -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
else
  step ".venv is up to date"
fi

# 3. etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm.
bash scripts/build-tools.sh >/dev/null
step "ready in $((SECONDS - started)) s"
