"""`python -m colocate_operator` / `colocate-operator`: run the operator against the current kubeconfig.

Credentials: in-cluster service account when running in a pod, else KUBECONFIG (or ~/.kube/config).
Logs are JSON lines on stderr; the liveness endpoint answers on --liveness (kopf's /healthz); Prometheus
metrics on --metrics-port.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from colocate_operator import kubeauth

# Before kopf is imported (it imports the kubernetes client library whenever it can): the library's 32 MiB
# stay out of the process unless the kubeconfig's user needs one of its plugins.
kubeauth.keep_client_library_out()

import kopf  # noqa: E402

from colocate_operator import handlers, leader, metrics  # noqa: E402
from colocate_operator.config import ConfigError, OperatorConfig  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="colocate-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; glob patterns allowed); default: all",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL, empty to disable (default: %(default)s)",
    )
    parser.add_argument(
        "--peering",
        default=None,
        help="kopf peering object name; default: standalone (run exactly one replica)",
    )
    parser.add_argument("--priority", type=int, default=0, help="peering priority (with --peering)")
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles and "
        "writes; the others stand by and take over when it stops renewing (the chart's default)",
    )
    parser.add_argument(
        "--leader-elect-namespace",
        default=None,
        help="namespace of the Lease (default: COLOCATE_OPERATOR_NAMESPACE, the operator's own)",
    )
    parser.add_argument(
        "--leader-elect-lease", default="colocate-operator", help="name of the Lease (default: %(default)s)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port at /metrics; 0 (default) disables",
    )
    parser.add_argument(
        "--allow-privileged-namespace",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="jobs in this namespace (repeatable; '*': any) may run privileged security contexts they opt in "
        "to with spec.pod.allowPrivileged; default: none",
    )
    parser.add_argument("--log-format", choices=["json", "plain"], default="json", help="default: json")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    # The HTTP client's debug logs would include request bodies (a Secret among them); keep them quiet.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)  # where a kubeconfig plugin needs the library
    try:
        config = OperatorConfig.from_env()
    except ConfigError as e:
        logging.getLogger("colocate_operator").error("invalid configuration: %s", e)
        return 2
    config = dataclasses.replace(config, privileged_namespaces=frozenset(args.allow_privileged_namespace))
    election = None
    if args.leader_elect:
        lease_namespace = args.leader_elect_namespace or config.operator_namespace
        if not lease_namespace:
            logging.getLogger("colocate_operator").error(
                "--leader-elect needs --leader-elect-namespace or COLOCATE_OPERATOR_NAMESPACE"
            )
            return 2
        identity = f"{leader.default_identity()}-{os.getpid()}"
        election = leader.Settings(lease_namespace, args.leader_elect_lease, identity)
        if args.peering:
            logging.getLogger("colocate_operator").error("--leader-elect and --peering exclude each other")
            return 2
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    registry = kopf.get_default_registry()
    handlers.register(registry, config, namespaces=args.namespace, election=election)
    kopf.run(
        registry=registry,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
