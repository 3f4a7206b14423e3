"""Worker-pod hardening on the real local apiserver: what the CRD refuses at admission, and a job's pods in a
namespace that enforces Pod Security "restricted" (kube-apiserver's PodSecurity admission, on by default).

kwok runs no container, so these tests prove what the apiserver admits and what the operator creates, not
what a kubelet would then do with the images.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.kube import wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, events, get, job_manifest, wait_phase

pytestmark = pytest.mark.integration

RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"
API_KEY_REF = {"name": "sglang-auth", "key": "api-key"}

# (case, spec override, words the apiserver's message must contain)
REFUSED = [
    (
        "deadline-3e11",
        {"runPolicy": {"activeDeadlineSeconds": 300_000_000_000}},
        "spec.runPolicy.activeDeadlineSeconds must be at most 31536000 seconds (365 days)",
    ),
    (
        "ttl-3e11",
        {"runPolicy": {"ttlSecondsAfterFinished": 300_000_000_000}},
        "spec.runPolicy.ttlSecondsAfterFinished must be at most 31536000 seconds (365 days)",
    ),
    (
        "equal-explicit-ports",
        {"trainer": {"port": 8000}, "rollout": {"port": 8000}},
        "spec.trainer.port and spec.rollout.port must differ",
    ),
    (
        "trainer-port-on-sglang-default",
        {"trainer": {"port": 30000}},
        "spec.trainer.port and spec.rollout.port must differ",
    ),
    (
        "trainer-widens-gpus",
        {"trainer": {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}},
        "env NVIDIA_VISIBLE_DEVICES is reserved",
    ),
    (
        "rollout-widens-gpus-from-a-configmap",
        {
            "gpu": {"allocation": "DevicePlugin"},
            "rollout": {
                "env": [
                    {
                        "name": "NVIDIA_VISIBLE_DEVICES",
                        "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                    }
                ]
            },
        },
        "env NVIDIA_VISIBLE_DEVICES is reserved",
    ),
    (
        "api-key-on-the-trainer",
        {"trainer": {"apiKeySecretRef": API_KEY_REF}},
        "spec.trainer.apiKeySecretRef is not used",
    ),
    (
        "api-key-twice",
        {"rollout": {"apiKeySecretRef": API_KEY_REF, "env": [{"name": "SGLANG_API_KEY", "value": "x"}]}},
        "env SGLANG_API_KEY is set from spec.rollout.apiKeySecretRef",
    ),
    (
        "api-key-without-key",
        {"rollout": {"apiKeySecretRef": {"name": "s"}}},
        "spec.rollout.apiKeySecretRef.key",
    ),
]


def dry_run_create(cluster, namespace: str, name: str, **override: Any):
    manifest = job_manifest(name, namespace, **override)
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)


@pytest.mark.parametrize(("case", "override", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_at_admission_with_a_message_naming_the_field(
    cluster, crd, namespace: str, case: str, override: dict[str, Any], message: str
) -> None:
    result = dry_run_create(cluster, namespace, f"bad-{case}"[:40], **override)
    assert result.returncode != 0, f"{case} was accepted"
    assert message in result.stderr, result.stderr


def test_bounds_and_new_fields_accept_what_is_valid(cluster, crd, namespace: str) -> None:
    """The other side of each rule: the largest bound, distinct ports, the key and securityContext."""
    result = dry_run_create(
        cluster,
        namespace,
        "good",
        runPolicy={"activeDeadlineSeconds": 31_536_000, "ttlSecondsAfterFinished": 31_536_000},
        trainer={"port": 30001, "securityContext": {"readOnlyRootFilesystem": True}},
        rollout={"apiKeySecretRef": API_KEY_REF, "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
        pod={"securityContext": {"runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}},
    )
    assert result.returncode == 0, result.stderr


def test_job_pods_are_admitted_where_pod_security_restricted_is_enforced(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    cluster.kubectl("label", "namespace", namespace, RESTRICTED)
    cluster.kubectl(
        "create",
        "secret",
        "generic",
        "sglang-auth",
        "-n",
        namespace,
        "--from-literal=api-key=k3y-for-the-test",
    )
    apply_job(cluster, namespace, rollout={"apiKeySecretRef": API_KEY_REF})
    wait_phase(cluster, namespace, "Running")  # the Redis pod (ReplicaSet-created) was admitted too
    items = get(cluster, namespace, "pods", "-l", "colocate.dev/job=demo")["items"]
    assert sorted(p["metadata"]["labels"]["colocate.dev/component"] for p in items) == [
        "metastore",
        "worker",
        "worker",
    ]
    for pod in items:
        if pod["metadata"]["labels"]["colocate.dev/component"] != "worker":
            continue
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert not any(v.get("projected") for v in pod["spec"]["volumes"]), "no service account token volume"
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["SGLANG_API_KEY"]["valueFrom"] == {
                "secretKeyRef": {"name": "sglang-auth", "key": "api-key"}
            }
        assert "k3y-for-the-test" not in json.dumps(pod)
    uid = get(cluster, namespace, "colocatejob", "demo")["metadata"]["uid"]
    policy = get(cluster, namespace, "networkpolicy", "demo-workers")
    assert [r["uid"] for r in policy["metadata"]["ownerReferences"]] == [uid]
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "colocate.dev/job": "demo",
        "colocate.dev/component": "worker",
    }


def test_pod_security_restricted_is_really_enforced_here(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    """The control: the same namespace refuses a job whose spec gives up runAsNonRoot, and the job's Events
    say why (so the test above could fail)."""
    cluster.kubectl("label", "namespace", namespace, RESTRICTED)
    apply_job(cluster, namespace, pod={"securityContext": {"runAsNonRoot": False}})

    def refused() -> list[str]:
        return [
            e["message"]
            for e in events(cluster, namespace)
            if e["reason"] == "FailedToCreate" and "PodSecurity" in e["message"]
        ]

    (message, *_) = wait_for(refused, 60, "a FailedToCreate event naming PodSecurity")
    assert "runAsNonRoot" in message, message
    assert get(cluster, namespace, "pods", "-l", "colocate.dev/component=worker")["items"] == []
