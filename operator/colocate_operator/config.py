"""Operator-wide settings, read once from the environment (and the command line) into a frozen object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from colocate_operator.addresses import AddressAllowList
from colocate_runtime.contract import env as contract


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
        seconds = {
            contract.RECONCILE_INTERVAL_SECONDS: "reconcile_interval_seconds",
            contract.MAX_BACKOFF_SECONDS: "max_backoff_seconds",
            contract.CREATE_DELAY_SECONDS: "create_delay_seconds",
            contract.FORCE_DELETE_AFTER_SECONDS: "force_delete_after_seconds",
        }
        for var, attr in seconds.items():
            value = _read(var, env)
            if value is not None:
                if value < 0:
                    raise ConfigError(f"{var.name} must not be negative, got {value}")
                kwargs[attr] = value
        workers = _read(contract.RECONCILE_WORKERS, env)
        if workers is not None:
            if not 1 <= workers <= 64:
                raise ConfigError(f"{contract.RECONCILE_WORKERS.name} must be from 1 to 64, got {workers}")
            kwargs["reconcile_workers"] = workers
        domain = _read(contract.CLUSTER_DOMAIN, env)
        if domain is not None:
            kwargs["cluster_domain"] = domain.strip(".")
        namespace = _read(contract.OPERATOR_NAMESPACE, env)
        if namespace is not None:
            kwargs["operator_namespace"] = namespace
        labels = _read(contract.OPERATOR_POD_LABELS, env)
        if labels is not None:
            kwargs["operator_pod_labels"] = parse_labels(labels, contract.OPERATOR_POD_LABELS.name)
        allow = _read(contract.EXTERNAL_METASTORE_ALLOW, env)
        if allow is not None:
            try:
                kwargs["external_metastore_allow"] = AddressAllowList.parse(allow)
            except ValueError as e:
                raise ConfigError(f"{contract.EXTERNAL_METASTORE_ALLOW.name}: {e}") from None
        config = cls(**kwargs)  # type: ignore[arg-type]
        if config.reconcile_interval_seconds <= 0:
            raise ConfigError("COLOCATE_RECONCILE_INTERVAL_SECONDS must be positive")
        return config

    def allows_privileged(self, namespace: str) -> bool:
        return "*" in self.privileged_namespaces or namespace in self.privileged_namespaces


def _read(var: contract.Var, env: Mapping[str, str]) -> Any:
    """The variable's typed value when it is set (None when unset or blank), parsed by the contract table."""
    try:
        return None if var.raw(env) is None else var.read(env)
    except contract.EnvError as err:
        raise ConfigError(str(err)) from None


def parse_labels(text: str, what: str) -> dict[str, str]:
    """`a=b,c=d` -> {"a": "b", "c": "d"}."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what}: expected key=value pairs separated by commas, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels
