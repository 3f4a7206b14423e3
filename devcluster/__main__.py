"""`python -m colocate_devcluster up|down|status`: the local control plane by hand."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from colocate_devcluster.cluster import GANG_SCHEDULING, STATE_FILE, Cluster, ClusterError, ClusterSpec
from colocate_devcluster.kueue import Kueue
from colocate_devcluster.processes import ComponentError, http_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colocate-devcluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("COLOCATE_DEVCLUSTER_DIR", ".devcluster")),
        help="where certificates, etcd data, logs and the kubeconfig live (default: .devcluster)",
    )
    parser.add_argument("--gpu-nodes", type=int, default=4, help="fake GPU nodes to create (default 4)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per fake node (default 8)")
    parser.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        help="real nodes (kubelet, containerd, runc, CNI; needs root and `make images`) beside the fake ones",
    )
    parser.add_argument(
        "--feature-gates",
        default="",
        help="feature gates for the apiserver, controller-manager and scheduler, e.g. GenericWorkload=true",
    )
    parser.add_argument(
        "--gang-scheduling",
        action="store_true",
        help="serve the Workload/PodGroup API and run the scheduler's gang plugin (GenericWorkload gate)",
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        help="also run Kueue (built by scripts/build-tools.sh) with its CRDs and webhooks",
    )
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    try:
        if args.command == "up":
            gates = tuple(g for g in args.feature_gates.split(",") if g)
            runtime_config: tuple[str, ...] = ()
            if args.gang_scheduling:
                gates += GANG_SCHEDULING["feature_gates"]
                runtime_config = GANG_SCHEDULING["runtime_config"]
            spec = ClusterSpec(
                workdir,
                args.gpu_nodes,
                args.gpus_per_node,
                feature_gates=gates,
                runtime_config=runtime_config,
                real_nodes=args.real_nodes,
            )
            cluster = Cluster(spec).start()
            if args.kueue:
                try:
                    Kueue(cluster).start()
                except BaseException:
                    cluster.stop()
                    raise
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(
                f"# kubectl and helm: {cluster.bin_dir}; stop with: python -m colocate_devcluster down",
                file=sys.stderr,
            )
            return 0
        if not (workdir / STATE_FILE).exists():
            print(f"no cluster running from {workdir}", file=sys.stderr)
            return 0 if args.command == "down" else 1
        cluster = Cluster.load(workdir)
        if args.command == "down":
            cluster.stop()
            print(f"stopped the cluster in {workdir}", file=sys.stderr)
            return 0
        for name, alive in cluster.status().items():
            print(f"{name:26} {'running' if alive else 'DEAD'}")
        ready = http_ok(f"{cluster.server}/readyz", token=cluster.token, ca=workdir / "pki" / "ca.crt")
        print(f"{'apiserver /readyz':26} {'ok' if ready else 'NOT READY'} ({cluster.server})")
        print(f"KUBECONFIG={cluster.kubeconfig}")
        return 0 if ready and cluster.any_alive() else 1
    except (ClusterError, ComponentError, OSError) as error:
        print(f"devcluster: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
