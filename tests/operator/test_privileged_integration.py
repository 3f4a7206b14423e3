"""Privileged containers through the security-context passthrough (issue 30, item 4), on the real control
plane: the API server refuses (CEL) `privileged`, added capabilities (beyond NET_BIND_SERVICE, as Pod
Security "restricted"), `Unconfined` seccomp and UID 0, naming the field, unless the job opts in with
`spec.pod.allowPrivileged: true`; a job that opts in gets pods only in a namespace the operator's
administrator listed (`--allow-privileged-namespace`, chart value `security.allowPrivilegedNamespaces`), and
otherwise a condition naming the fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.kube import ChartIdentity, render_chart, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    condition_reason,
    job_event_reasons,
    job_manifest,
    pods,
    running_pods,
)

pytestmark = pytest.mark.integration

PRIVILEGED: list[tuple[str, dict[str, Any], str]] = [
    (
        "privileged",
        {"trainer": {"securityContext": {"privileged": True}}},
        "spec.trainer.securityContext.privileged",
    ),
    (
        "capabilities",
        {"rollout": {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}},
        "spec.rollout.securityContext.capabilities.add",
    ),
    (
        "unconfined-container",
        {"trainer": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
        "spec.trainer.securityContext.seccompProfile",
    ),
    (
        "unconfined-pod",
        {"pod": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
        "spec.pod.securityContext.seccompProfile",
    ),
    (
        "uid-0-container",
        {"rollout": {"securityContext": {"runAsUser": 0}}},
        "spec.rollout.securityContext.runAsUser",
    ),
    ("uid-0-pod", {"pod": {"securityContext": {"runAsUser": 0}}}, "spec.pod.securityContext.runAsUser"),
]


def dry_run(cluster: Any, manifest: dict[str, Any]) -> Any:
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)


def chart_args(cluster: Any, *values: str) -> tuple[str, ...]:
    """The operator's privileged-namespace options as the chart renders them from `values`."""
    (deployment,) = [d for d in render_chart(cluster, *values) if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return tuple(a for a in args if a.startswith("--allow-privileged-namespace"))


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize(("case", "override", "field"), PRIVILEGED, ids=[c[0] for c in PRIVILEGED])
def test_privileged_security_contexts_are_refused_naming_the_field(
    cluster: Any, crd: Path, namespace: str, case: str, override: dict[str, Any], field: str
) -> None:
    manifest = job_manifest(f"priv-{case}"[:40], namespace, gpusPerNode=1, **override)
    refused = dry_run(cluster, manifest)
    assert refused.returncode != 0, f"{case} was accepted"
    assert field in refused.stderr and "spec.pod.allowPrivileged" in refused.stderr, refused.stderr
    # The job's own opt-in gets it past the API server; the operator decides (below).
    manifest["spec"] = merged(manifest["spec"], {"pod": {"allowPrivileged": True}})
    accepted = dry_run(cluster, manifest)
    assert accepted.returncode == 0, accepted.stderr
    # What restricted allows stays allowed without it.
    harmless = job_manifest(
        "harmless",
        namespace,
        gpusPerNode=1,
        trainer={"securityContext": {"runAsUser": 1000, "capabilities": {"add": ["NET_BIND_SERVICE"]}}},
        pod={"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
    )
    assert dry_run(cluster, harmless).returncode == 0


def test_an_opted_in_job_gets_pods_only_where_the_operator_allows_it(
    cluster: Any, namespace: str, tmp_path: Path, operator_identity: ChartIdentity
) -> None:
    spec = {
        "gpusPerNode": 1,
        "trainer": {"securityContext": {"privileged": True}},
        "pod": {"allowPrivileged": True, "securityContext": {"runAsUser": 0}},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(job_manifest("demo", namespace, **spec)))
    refusing = OperatorProcess(namespace, tmp_path / "operator-1.log", operator_identity).start()
    try:
        held = condition_reason(cluster, namespace, "PodsReady", "PrivilegedNotAllowed")
        assert "spec.trainer.securityContext.privileged" in held["message"], held
        assert "spec.pod.securityContext.runAsUser" in held["message"], held
        assert "security.allowPrivilegedNamespaces" in held["message"], held
        assert not pods(cluster, namespace)
        assert "PrivilegedNotAllowed" in job_event_reasons(cluster, namespace)
    finally:
        refusing.stop()
    # The administrator lists the namespace in the chart's values: the operator runs with what they render.
    assert not chart_args(cluster), "none by default"
    args = chart_args(cluster, "--set", f"security.allowPrivilegedNamespaces={{{namespace}}}")
    assert args == (f"--allow-privileged-namespace={namespace}",)
    allowing = OperatorProcess(namespace, tmp_path / "operator-2.log", operator_identity, args=args).start()
    try:
        (worker, _) = running_pods(cluster, namespace, 2, 0)
    finally:
        allowing.stop()
    trainer = next(c for c in worker["spec"]["containers"] if c["name"] == "trainer")
    assert trainer["securityContext"]["privileged"] is True
    assert worker["spec"]["securityContext"]["runAsUser"] == 0
    wait_for(lambda: len(pods(cluster, namespace)) == 2 or None, 10, "both pods")
