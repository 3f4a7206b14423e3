#!/usr/bin/env bash
# `make demo`: brings up the local control plane with fake GPU nodes and shows how to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
workdir=${COLOCATE_DEVCLUSTER_DIR:-.devcluster}
.venv/bin/python -m colocate_devcluster down --workdir "$workdir" >/dev/null 2>&1 || true
.venv/bin/python -m colocate_devcluster up --workdir "$workdir" >/dev/null
export KUBECONFIG=$PWD/$workdir/kubeconfig PATH=$COLOCATE_BIN_DIR:$PATH
echo
echo "== nodes (kwok fake GPU nodes; no container ever runs)"
kubectl get nodes -L colocate.dev/gpu-node -o wide | cut -c1-100
echo
echo "== GPUs offered through DRA"
kubectl get deviceclasses,resourceslices
cat <<MSG

The cluster keeps running. Use it with:
  export KUBECONFIG=$KUBECONFIG
  export PATH=$COLOCATE_BIN_DIR:\$PATH      # kubectl, helm
  kubectl get nodes
Stop it with:  make cluster-down
MSG
