"""Operator-wide settings, read once from the environment (and the command line) into a frozen object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from colocate_operator.addresses import AddressAllowList


class ConfigError(ValueError):
    """A setting a user can fix; the message names the variable."""


@dataclass(frozen=True)
class OperatorConfig:
    # Level-based reconcile: every job is compared with all its children at least this often (watch
    # events of the job, its pods and its meta-store trigger passes in between).
    reconcile_interval_seconds: float = 120.0
    # Threads running reconcile passes; a pass mostly waits on the API server.
    reconcile_workers: int = 4
    # Used to build the FQDNs of the rendezvous and meta-store addresses handed to the pods.
    cluster_domain: str = "cluster.local"
    # Where the operator itself runs: the meta-store NetworkPolicy admits pods with these labels there.
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "colocate-operator"}
    )
    # Cap of the exponential restart backoff.
    max_backoff_seconds: float = 300.0
    # A pod still Terminating this long after its grace period ended sits on a node that no longer answers
    # (its kubelet would have confirmed): it is deleted with grace 0 so the group restart can go on.
    force_delete_after_seconds: float = 120.0
    # Fault injection for tests only: pause between pod creations so a test can kill the operator mid-way.
    create_delay_seconds: float = 0.0
    # External meta-store addresses the operator may dial with a job's password (addresses.py); none: every
    # External job is refused.
    external_metastore_allow: AddressAllowList = field(default_factory=AddressAllowList)
    # Namespaces whose jobs may run privileged security contexts (pods.privileged_fields), `*` any: the
    # command line's --allow-privileged-namespace (chart value security.allowPrivilegedNamespaces). None by
    # default: such a job gets no pods.
    privileged_namespaces: frozenset[str] = frozenset()
    # The cluster serves the Workload/PodGroup API (gang.py): set at start from API discovery, not the env.
    native_gang: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}
        floats = {
            "COLOCATE_RECONCILE_INTERVAL_SECONDS": "reconcile_interval_seconds",
            "COLOCATE_MAX_BACKOFF_SECONDS": "max_backoff_seconds",
            "COLOCATE_CREATE_DELAY_SECONDS": "create_delay_seconds",
            "COLOCATE_FORCE_DELETE_AFTER_SECONDS": "force_delete_after_seconds",
        }
        for var, attr in floats.items():
            if env.get(var):
                try:
                    value = float(env[var])
                except ValueError:
                    raise ConfigError(f"{var} must be a number of seconds, got {env[var]!r}") from None
                if value < 0:
                    raise ConfigError(f"{var} must not be negative, got {value}")
                kwargs[attr] = value
        if env.get("COLOCATE_RECONCILE_WORKERS"):
            workers = env["COLOCATE_RECONCILE_WORKERS"]
            if not workers.isdigit() or not 1 <= int(workers) <= 64:
                raise ConfigError(
                    f"COLOCATE_RECONCILE_WORKERS must be a whole number from 1 to 64, got {workers!r}"
                )
            kwargs["reconcile_workers"] = int(workers)
        if env.get("COLOCATE_CLUSTER_DOMAIN"):
            kwargs["cluster_domain"] = env["COLOCATE_CLUSTER_DOMAIN"].strip(".")
        if env.get("COLOCATE_OPERATOR_NAMESPACE"):
            kwargs["operator_namespace"] = env["COLOCATE_OPERATOR_NAMESPACE"]
        if env.get("COLOCATE_OPERATOR_POD_LABELS"):
            kwargs["operator_pod_labels"] = parse_labels(
                env["COLOCATE_OPERATOR_POD_LABELS"], "COLOCATE_OPERATOR_POD_LABELS"
            )
        if env.get("COLOCATE_EXTERNAL_METASTORE_ALLOW"):
            try:
                kwargs["external_metastore_allow"] = AddressAllowList.parse(
                    env["COLOCATE_EXTERNAL_METASTORE_ALLOW"]
                )
            except ValueError as e:
                raise ConfigError(f"COLOCATE_EXTERNAL_METASTORE_ALLOW: {e}") from None
        config = cls(**kwargs)  # type: ignore[arg-type]
        if config.reconcile_interval_seconds <= 0:
            raise ConfigError("COLOCATE_RECONCILE_INTERVAL_SECONDS must be positive")
        return config

    def allows_privileged(self, namespace: str) -> bool:
        return "*" in self.privileged_namespaces or namespace in self.privileged_namespaces


def parse_labels(text: str, what: str) -> dict[str, str]:
    """`a=b,c=d` -> {"a": "b", "c": "d"}."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what}: expected key=value pairs separated by commas, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels
