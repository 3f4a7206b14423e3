"""The operator on the real local control plane: apiserver + controller-manager + scheduler + kwok.

Pods really get scheduled onto the fake GPU nodes and DRA claims really get allocated; kwok moves them to
Running (no container ever runs). Failures are injected by patching a pod's status or deleting it.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import StepEvent, final_termination_message, stream_key, xadd
from tests.kube import ChartIdentity, external_metastore, metastore_secret, wait_for
from tests.operator import factories
from tests.operator.harness import OperatorProcess

pytestmark = pytest.mark.integration

WORKER = "colocate.dev/component=worker"


def job_manifest(name: str, namespace: str, **override: Any) -> dict[str, Any]:
    body = factories.body(name, namespace, **override)
    body["metadata"] = {"name": name, "namespace": namespace}
    return body


def apply_job(cluster, namespace: str, name: str = "demo", **override: Any) -> dict[str, Any]:
    manifest = job_manifest(name, namespace, **override)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    return manifest


def get(cluster, namespace: str, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-n", namespace, *args, "-o", "json").stdout)


def job_status(cluster, namespace: str, name: str = "demo") -> dict[str, Any]:
    return get(cluster, namespace, "colocatejob", name).get("status") or {}


def pods(cluster, namespace: str, name: str = "demo") -> list[dict[str, Any]]:
    items = get(cluster, namespace, "pods", "-l", f"colocate.dev/job={name},{WORKER}")["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def wait_phase(
    cluster, namespace: str, phase: str, timeout: float = 60, name: str = "demo"
) -> dict[str, Any]:
    return wait_for(
        lambda: (s := job_status(cluster, namespace, name)).get("phase") == phase and s,
        timeout,
        f"ColocateJob {namespace}/{name} phase {phase}",
    )


def wait_condition(
    cluster, namespace: str, type_: str, status: str, timeout: float = 30, name: str = "demo"
) -> dict[str, Any]:
    """Wait until the job's condition `type_` has `status`; returns the job's status then."""
    return wait_for(
        lambda: (
            (s := job_status(cluster, namespace, name)) and condition(s, type_).get("status") == status and s
        ),
        timeout,
        f"{type_}={status} on ColocateJob {namespace}/{name}",
    )


def running_pods(cluster, namespace: str, count: int, restart: int) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        items = pods(cluster, namespace)
        ok = len(items) == count and all(
            p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
            and p["metadata"]["labels"]["colocate.dev/restart"] == str(restart)
            for p in items
        )
        return items if ok else None

    return wait_for(probe, 60, f"{count} Running pods of group restart {restart}")


def fail_pod(cluster, namespace: str, pod: str) -> None:
    patch = {"status": {"phase": "Failed", "reason": "Error", "message": "trainer exited with code 1"}}
    patch_pod_status(cluster, namespace, pod, patch)


def patch_pod_status(cluster, namespace: str, pod: str, patch: dict[str, Any]) -> None:
    """What a kubelet would report (kwok runs no containers)."""
    cluster.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(patch)
    )


def events(cluster, namespace: str) -> list[dict[str, Any]]:
    return get(cluster, namespace, "events")["items"]


def job_event_reasons(cluster, namespace: str) -> set[str]:
    return {e["reason"] for e in events(cluster, namespace) if e["involvedObject"]["kind"] == "ColocateJob"}


def test_happy_path_both_containers_share_one_allocated_claim(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    started = time.monotonic()
    apply_job(cluster, namespace, numNodes=4, gpusPerNode=4)
    status = wait_phase(cluster, namespace, "Running")
    elapsed = time.monotonic() - started
    items = running_pods(cluster, namespace, 4, 0)
    assert len({p["spec"]["nodeName"] for p in items}) == 4, "one pod per node"
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in items)
    claims = {c["metadata"]["name"]: c for c in get(cluster, namespace, "resourceclaims")["items"]}
    for pod in items:
        assert pod["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "demo-gpus"}]
        for container in pod["spec"]["containers"]:
            assert container["resources"]["claims"] == [{"name": "gpus"}]
        (claim_status,) = pod["status"]["resourceClaimStatuses"]
        claim = claims[claim_status["resourceClaimName"]]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 4
        assert {r["pool"] for r in results} == {pod["spec"]["nodeName"]}, "devices of the pod's own node"
        assert {r["driver"] for r in results} == {"gpu.nvidia.com"}
        assert [c["uid"] for c in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]
    assert status["ready"] == "4/4" and status["restarts"] == 0
    assert status["observedGeneration"] == 1
    for type_ in ("MetaStoreReady", "ResourcesAllocated", "PodsReady"):
        assert condition(status, type_)["status"] == "True", type_
    assert condition(status, "ResourcesAllocated")["reason"] == "ClaimsAllocated"
    assert [c["pod"] for c in status["resourceClaims"]] == [f"demo-{i}" for i in range(4)]
    assert all(c["allocated"] and len(c["devices"]) == 4 for c in status["resourceClaims"])
    printed = cluster.kubectl("get", "colocatejob", "demo", "-n", namespace).stdout
    assert "Running" in printed and "4/4" in printed
    assert {"CreatedMetaStore", "CreatedPods", "JobRunning"} <= job_event_reasons(cluster, namespace)
    print(f"\n[happy path] apply -> Running: {elapsed:.1f} s")


def test_every_child_is_owned_and_garbage_collected_even_with_the_operator_down(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace)
    wait_phase(cluster, namespace, "Running")
    uid = get(cluster, namespace, "colocatejob", "demo")["metadata"]["uid"]
    kinds = "pods,services,secrets,deployments,networkpolicies,poddisruptionbudgets,resourceclaimtemplates"
    children = get(cluster, namespace, kinds, "-l", "colocate.dev/job=demo")["items"]
    assert {c["kind"] for c in children} == {
        "Pod",
        "Service",
        "Secret",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ResourceClaimTemplate",
    }
    for child in children:
        if child["kind"] == "Pod" and child["metadata"]["labels"]["colocate.dev/component"] == "metastore":
            continue  # Redis pods belong to the Deployment's ReplicaSet
        refs = child["metadata"]["ownerReferences"]
        assert [(r["uid"], r["controller"]) for r in refs] == [(uid, True)], child["metadata"]["name"]
    assert len(get(cluster, namespace, "resourceclaims")["items"]) == 2

    assert not get(cluster, namespace, "colocatejob", "demo")["metadata"].get("finalizers")
    # With the operator down, deletion must not wait for it: ownerReferences, no finalizers.
    operator_process.stop()
    cluster.kubectl("delete", "colocatejob", "demo", "-n", namespace, "--timeout=30s")

    def leftovers() -> list[str]:
        kinds_all = f"{kinds},replicasets,resourceclaims"
        items = get(cluster, namespace, kinds_all)["items"]
        return [
            f"{i['kind']}/{i['metadata']['name']}" for i in items if i["metadata"]["name"] != "kubernetes"
        ]

    wait_for(lambda: not leftovers() or None, 60, "every child garbage-collected")
    assert leftovers() == []


def test_pod_failure_restarts_whole_group_then_fails_after_max_restarts(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, runPolicy={"maxRestarts": 1, "backoffSeconds": 0})
    wait_phase(cluster, namespace, "Running")
    first = running_pods(cluster, namespace, 2, 0)

    fail_pod(cluster, namespace, "demo-1")
    second = running_pods(cluster, namespace, 2, 1)
    assert {p["metadata"]["uid"] for p in second}.isdisjoint(p["metadata"]["uid"] for p in first), (
        "every pod of the group is recreated, not just the failed one"
    )
    status = wait_phase(cluster, namespace, "Running")
    assert status["restarts"] == 1
    assert condition(status, "Restarting")["status"] == "False"
    assert "RestartingGroup" in job_event_reasons(cluster, namespace)
    scraped = operator_process.metrics()
    assert f'colocate_job_restarts{{job="demo",namespace="{namespace}"}} 1.0' in scraped
    assert 'colocate_status_writes_total{writer="reconciler"}' in scraped

    cluster.kubectl("delete", "pod", "demo-0", "-n", namespace, "--wait=false")  # a deleted pod counts too
    status = wait_phase(cluster, namespace, "Failed")
    failed = condition(status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "MaxRestartsExceeded")
    assert "demo-0" in failed["message"]
    assert status["restarts"] == 1 and status.get("completionTime")
    wait_for(lambda: not pods(cluster, namespace) or None, 30, "pods of the failed job deleted")
    assert "JobFailed" in job_event_reasons(cluster, namespace)


def test_suspend_deletes_pods_keeps_metastore_and_resumes(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace)
    wait_phase(cluster, namespace, "Running")
    secret_uid = get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"]
    deployment_uid = get(cluster, namespace, "deployment", "demo-metastore")["metadata"]["uid"]

    cluster.kubectl(
        "patch", "colocatejob", "demo", "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}'
    )
    status = wait_phase(cluster, namespace, "Suspended")
    wait_for(lambda: not pods(cluster, namespace) or None, 30, "pods deleted on suspend")
    assert condition(status, "Suspended")["status"] == "True"
    assert get(cluster, namespace, "deployment", "demo-metastore")["metadata"]["uid"] == deployment_uid
    assert not get(cluster, namespace, "resourceclaims")["items"] or wait_for(
        lambda: not get(cluster, namespace, "resourceclaims")["items"], 30, "claims released"
    )

    # Pod-shaping fields may change while suspended.
    cluster.kubectl(
        "patch",
        "colocatejob",
        "demo",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"trainer": {"image": "example.com/trainer:2"}}}',
    )
    cluster.kubectl(
        "patch", "colocatejob", "demo", "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": false}}'
    )
    status = wait_phase(cluster, namespace, "Running")
    items = running_pods(cluster, namespace, 2, 0)
    assert status["restarts"] == 0, "suspend and resume do not count as restarts"
    assert condition(status, "Suspended")["status"] == "False"
    assert {p["spec"]["containers"][0]["image"] for p in items} == {"example.com/trainer:2"}
    assert get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"] == secret_uid
    assert {"SuspendedByUser", "Resumed"} <= job_event_reasons(cluster, namespace)


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    cluster, namespace: str, tmp_path, operator_identity: ChartIdentity
) -> None:
    slow = OperatorProcess(
        namespace, tmp_path / "operator-1.log", operator_identity, COLOCATE_CREATE_DELAY_SECONDS="2"
    ).start()
    try:
        apply_job(cluster, namespace, numNodes=4, gpusPerNode=4)
        wait_for(lambda: len(pods(cluster, namespace)) >= 1, 60, "the first pod created")
        slow.kill()
    finally:
        slow.stop()
    partial = len(pods(cluster, namespace))
    assert 1 <= partial < 4, f"killed mid-way: {partial} of 4 pods exist"
    assert job_status(cluster, namespace).get("groupCreated") is not True

    restarted = OperatorProcess(namespace, tmp_path / "operator-2.log", operator_identity).start()
    try:
        status = wait_phase(cluster, namespace, "Running")
        items = running_pods(cluster, namespace, 4, 0)
        # Stable for a few reconcile intervals: no extra pods, no restarts.
        time.sleep(5)
        again = pods(cluster, namespace)
        assert [p["metadata"]["uid"] for p in again] == [p["metadata"]["uid"] for p in items]
        assert sorted(p["metadata"]["labels"]["colocate.dev/replica-index"] for p in again) == [
            "0",
            "1",
            "2",
            "3",
        ]
        assert job_status(cluster, namespace)["restarts"] == 0 and status["groupCreated"] is True
        assert len(get(cluster, namespace, "secrets", "-l", "colocate.dev/job=demo")["items"]) == 1
        assert len(get(cluster, namespace, "resourceclaims")["items"]) == 4
    finally:
        restarted.stop()


def test_redis_password_appears_in_no_pod_spec_log_or_event(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, runPolicy={"backoffSeconds": 0})
    wait_phase(cluster, namespace, "Running")
    fail_pod(cluster, namespace, "demo-0")  # a restart: more events, more pods, more log lines
    running_pods(cluster, namespace, 2, 1)
    wait_phase(cluster, namespace, "Running")
    secret = get(cluster, namespace, "secret", "demo-metastore-auth")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32
    worker_password = base64.b64decode(secret["data"]["worker-password"]).decode()
    assert secret["immutable"] is True
    config = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert password not in config and worker_password not in config  # digests only
    # Immutable: an edit cannot split Redis and the pods (a new password is a new Secret, decide.py).
    edit = cluster.kubectl(
        "patch",
        "secret",
        "demo-metastore-auth",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"stringData": {"password": "x" * 40}}),
        check=False,
    )
    assert edit.returncode != 0 and "immutable" in edit.stderr, edit.stderr

    for pod in [
        *pods(cluster, namespace),
        *get(cluster, namespace, "pods", "-l", "colocate.dev/component=metastore")["items"],
    ]:
        text = json.dumps(pod)
        assert password not in text and worker_password not in text, pod["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            refs = [e for e in container.get("env") or [] if e["name"] == "COLOCATE_METASTORE_PASSWORD"]
            if pod["metadata"]["labels"]["colocate.dev/component"] == "worker":
                assert refs == [
                    {
                        "name": "COLOCATE_METASTORE_PASSWORD",
                        "valueFrom": {
                            "secretKeyRef": {"name": "demo-metastore-auth", "key": "worker-password"}
                        },
                    }
                ]
    others = get(cluster, namespace, "deployments,replicasets,services,networkpolicies,colocatejobs,events")
    assert password not in json.dumps(others) and worker_password not in json.dumps(others)
    all_events = events(cluster, namespace)
    assert len(all_events) > 5
    # kopf's own log lines are not posted as Events (they would carry reason "Logging").
    job_events = [e for e in all_events if e["involvedObject"]["kind"] == "ColocateJob"]
    assert job_events and {e["source"]["component"] for e in job_events} == {"colocate-operator"}
    assert not [e for e in all_events if e["reason"] == "Logging"]
    log = operator_process.log()
    assert "status updated" in log and password not in log
    assert base64.b64encode(password.encode()).decode() not in log


def test_devices_from_the_device_plugin_fallback(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, gpu={"allocation": "DevicePlugin"}, gpusPerNode=8)
    status = wait_phase(cluster, namespace, "Running")
    assert condition(status, "ResourcesAllocated")["reason"] == "DevicePluginFallback"
    items = running_pods(cluster, namespace, 2, 0)
    for pod in items:
        trainer, rollout = pod["spec"]["containers"]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert "nvidia.com/gpu" not in (rollout.get("resources") or {}).get("limits", {})
        assert "resourceClaims" not in pod["spec"]
    assert get(cluster, namespace, "resourceclaimtemplates")["items"] == []


def test_external_metastore_waits_for_its_secret(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    external = {
        "mode": "External",
        "external": {
            "address": "redis.shared.svc.cluster.local:6379",
            "passwordSecretRef": {"name": "shared-redis"},
        },
    }
    apply_job(cluster, namespace, metaStore=external)
    wait_for(
        lambda: condition(job_status(cluster, namespace), "MetaStoreReady").get("reason") == "SecretNotFound",
        60,
        "MetaStoreReady=False/SecretNotFound",
    )
    assert job_status(cluster, namespace)["phase"] != "Running"
    cluster.kubectl(
        "create", "secret", "generic", "shared-redis", "-n", namespace, "--from-literal=password=x"
    )
    status = wait_phase(cluster, namespace, "Running")
    assert status["metaStore"] == {
        "mode": "External",
        "address": "redis.shared.svc.cluster.local:6379",
        "secretName": "shared-redis",
    }
    assert get(cluster, namespace, "deployments")["items"] == []


INVALID_CREATES = [
    ("num-nodes-zero", {"numNodes": 0}, "spec.numNodes"),
    ("gpus-per-node-too-many", {"gpusPerNode": 65}, "spec.gpusPerNode"),
    ("train-layout-does-not-fit", {"parallelism": {"train": {"tensor": 3}}}, "spec.parallelism.train"),
    (
        "train-expert-does-not-fit",
        {"parallelism": {"train": {"expert": 32}}},
        "spec.parallelism.train.expert",
    ),
    (
        "inference-engine-wider-than-a-pod",
        {"parallelism": {"inference": {"tensor": 16}}},
        "spec.parallelism.inference.tensor",
    ),
    (
        "inference-data-does-not-divide-tensor",
        {"parallelism": {"inference": {"tensor": 8, "data": 3}}},
        "spec.parallelism.inference.data",
    ),
    (
        "inference-expert-does-not-divide",
        {"parallelism": {"inference": {"tensor": 8, "expert": 3}}},
        "spec.parallelism.inference.expert",
    ),
    ("unknown-gpu-allocation", {"gpu": {"allocation": "MIG"}}, "spec.gpu.allocation"),
    ("external-without-address", {"metaStore": {"mode": "External"}}, "spec.metaStore.external"),
    (
        "managed-with-external",
        {"metaStore": {"external": {"address": "r:6379", "passwordSecretRef": {"name": "s"}}}},
        "spec.metaStore.external",
    ),
    (
        "reserved-env-name",
        {"trainer": {"env": [{"name": "COLOCATE_JOB_NAME", "value": "x"}]}},
        "spec.trainer.env[0].name",
    ),
    (
        "gpu-in-container-resources",
        {"rollout": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
        "spec.rollout.resources.limits",
    ),
    ("unknown-model-arch", {"model": {"arch": "llama"}}, "spec.model.arch"),
    ("bad-shm-size", {"pod": {"shmSize": "lots"}}, "spec.pod.shmSize"),
    ("unknown-transport", {"weightSync": {"transport": "TCP"}}, "spec.weightSync.transport"),
    (
        "external-address-without-port",
        {
            "metaStore": {
                "mode": "External",
                "external": {"address": "redis", "passwordSecretRef": {"name": "s"}},
            }
        },
        "spec.metaStore.external.address",
    ),
    ("negative-max-restarts", {"runPolicy": {"maxRestarts": -1}}, "spec.runPolicy.maxRestarts"),
]


@pytest.mark.parametrize(("case", "override", "field"), INVALID_CREATES, ids=[c[0] for c in INVALID_CREATES])
def test_invalid_spec_rejected_with_field_named(
    cluster, crd, namespace: str, case: str, override: dict[str, Any], field: str
) -> None:
    manifest = job_manifest(f"bad-{case}"[:40], namespace, **override)
    result = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr


def test_invalid_names_and_missing_fields_rejected(cluster, crd, namespace: str) -> None:
    for name, override, field in [
        ("x" * 41, {}, "metadata.name"),
        ("9starts-with-digit", {}, "metadata.name"),
        ("no-image", {"trainer": {"image": ""}}, "spec.trainer.image"),
    ]:
        manifest = job_manifest(name, namespace, **override)
        result = cluster.kubectl(
            "create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False
        )
        assert result.returncode != 0 and field in result.stderr, (name, result.stderr)


IMMUTABLE_UPDATES = [
    ("num-nodes", {"spec": {"numNodes": 4}}, "spec.numNodes is immutable"),
    ("gpus-per-node", {"spec": {"gpusPerNode": 4}}, "spec.gpusPerNode is immutable"),
    ("gpu", {"spec": {"gpu": {"deviceClassName": "other.example.com"}}}, "spec.gpu is immutable"),
    (
        "metastore-mode",
        {
            "spec": {
                "metaStore": {
                    "mode": "External",
                    "external": {"address": "r:6379", "passwordSecretRef": {"name": "s"}},
                }
            }
        },
        "spec.metaStore.mode is immutable",
    ),
    ("trainer-while-running", {"spec": {"trainer": {"image": "t:2"}}}, "spec.trainer may only change"),
    ("rollout-while-running", {"spec": {"rollout": {"image": "s:2"}}}, "spec.rollout may only change"),
    ("parallelism-while-running", {"spec": {"parallelism": {"train": {"tensor": 2}}}}, "spec.parallelism"),
]


def test_immutable_fields_rejected_on_update(cluster, crd, namespace: str) -> None:
    apply_job(cluster, namespace)  # no operator needed: this is the API server's validation alone
    for case, patch, message in IMMUTABLE_UPDATES:
        result = cluster.kubectl(
            "patch",
            "colocatejob",
            "demo",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps(patch),
            "--dry-run=server",
            check=False,
        )
        assert result.returncode != 0, f"{case} was accepted"
        assert message in result.stderr, (case, result.stderr)
    # Suspending and changing the trainer in one update is allowed (pods are recreated on resume).
    cluster.kubectl(
        "patch",
        "colocatejob",
        "demo",
        "-n",
        namespace,
        "--type=merge",
        "--dry-run=server",
        "-p",
        json.dumps({"spec": {"suspend": True, "trainer": {"image": "t:2"}}}),
    )


def test_periodic_resync_repairs_children_nobody_watches(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace)
    wait_phase(cluster, namespace, "Running")
    old = get(cluster, namespace, "service", "demo")["metadata"]["uid"]
    # The operator watches pods and the Redis Deployment, not Services or NetworkPolicies: only the
    # periodic resync (2 s in these tests) can notice these are gone.
    cluster.kubectl("delete", "service", "demo", "-n", namespace)
    cluster.kubectl("delete", "networkpolicy", "demo-metastore", "-n", namespace)

    def repaired() -> bool:
        services = get(cluster, namespace, "services", "-l", "colocate.dev/job=demo")["items"]
        policies = get(cluster, namespace, "networkpolicies")["items"]
        return any(s["metadata"]["name"] == "demo" and s["metadata"]["uid"] != old for s in services) and any(
            p["metadata"]["name"] == "demo-metastore" for p in policies
        )

    wait_for(repaired, 30, "headless Service and NetworkPolicy recreated")
    assert job_status(cluster, namespace)["restarts"] == 0
    # The resync read the namespace with lists (metadata only for the children) under the chart's RBAC.
    assert "resync lists of namespace" not in operator_process.log()


# Issue 17 items 8-11 on the real plane ---------------------------------------------------------------------


def condition_reason(cluster, namespace: str, type_: str, reason: str, name: str = "demo") -> dict[str, Any]:
    return wait_for(
        lambda: (c := condition(job_status(cluster, namespace, name), type_)).get("reason") == reason and c,
        60,
        f"{type_}={reason} on ColocateJob {namespace}/{name}",
    )


def job_events(cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in events(cluster, namespace)
        if e["involvedObject"]["kind"] == "ColocateJob" and e["reason"] == reason
    ]


def test_a_job_name_that_would_take_another_jobs_redis_service_is_refused(
    cluster, crd, namespace: str
) -> None:
    manifest = job_manifest("x-metastore", namespace)
    result = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0 and "must not end in -metastore" in result.stderr, result.stderr
    cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(job_manifest("x-metastores", namespace))
    )


def test_an_object_holding_a_childs_name_is_a_condition_on_the_job(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    """Someone else's Service holds the Redis Service's name: the job says so, creates no pods (they would
    send the password there) and posts one Event, not one a second; freed, the name becomes the job's."""
    squatter = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo-metastore", "namespace": namespace},
        "spec": {"ports": [{"port": 6379}], "selector": {"app": "elsewhere"}},
    }
    cluster.apply([squatter])
    apply_job(cluster, namespace)
    meta = condition_reason(cluster, namespace, "MetaStoreReady", "NameTaken")
    assert f"Service {namespace}/demo-metastore exists, not owned by this job" in meta["message"]
    assert condition(job_status(cluster, namespace), "PodsReady")["reason"] == "NameTaken"
    time.sleep(5)  # a few passes (the resync runs every 2 s here)
    assert pods(cluster, namespace) == []
    assert len(job_events(cluster, namespace, "NameTaken")) == 1
    assert job_status(cluster, namespace)["phase"] == "Pending"
    # Nor does the operator's step follower send the job's password there.
    assert (
        f"services {namespace}/demo-metastore is not owned by the job: not dialing it"
        in operator_process.log()
    )

    cluster.kubectl("delete", "service", "demo-metastore", "-n", namespace)
    wait_phase(cluster, namespace, "Running")
    uid = get(cluster, namespace, "colocatejob", "demo")["metadata"]["uid"]
    owners = get(cluster, namespace, "service", "demo-metastore")["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == [uid]


def test_a_pod_holding_a_pods_name_is_a_condition_not_a_create_loop(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    squatter = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-1", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "example.com/other:1"}]},
    }
    cluster.apply([squatter])
    apply_job(cluster, namespace)
    ready = condition_reason(cluster, namespace, "PodsReady", "NameTaken")
    assert f"Pod {namespace}/demo-1 exists, not owned by this job" in ready["message"]
    time.sleep(5)
    assert len(job_events(cluster, namespace, "CreatedPods")) <= 2, "no CreatedPods Event every second"
    assert len(job_events(cluster, namespace, "NameTaken")) == 1
    assert get(cluster, namespace, "pod", "demo-1")["metadata"].get("ownerReferences") is None


def hold_secret(cluster, namespace: str, finalizers: list[str] | None) -> None:
    """Keep the job's meta-store Secret from being deleted (a finalizer), or let it go (None)."""
    patch = {"metadata": {"finalizers": finalizers}}
    cluster.kubectl(
        "patch", "secret", "demo-metastore-auth", "-n", namespace, "--type=merge", "-p", json.dumps(patch)
    )


def test_a_job_recreated_while_its_predecessors_secret_is_collected_waits_for_its_own(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    """M3: the predecessor's Secret (same name, old password) is still there, being deleted. Neither Redis
    nor the pods may start on it; once it is gone, the job's own Secret comes first, then Redis and pods."""
    apply_job(cluster, namespace)
    wait_phase(cluster, namespace, "Running")
    hold_secret(cluster, namespace, ["example.com/hold"])
    old_secret = get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"]
    cluster.kubectl("delete", "colocatejob", "demo", "-n", namespace, "--wait=true", "--timeout=30s")

    def collected() -> bool:
        return not get(cluster, namespace, "deployments")["items"] and not pods(cluster, namespace)

    wait_for(
        lambda: collected() or None,
        60,
        "the predecessor's Redis and pods collected",
    )
    apply_job(cluster, namespace)
    meta = condition_reason(cluster, namespace, "MetaStoreReady", "NameTaken")
    assert "Secret" in meta["message"] and "(being deleted)" in meta["message"]
    time.sleep(4)
    assert get(cluster, namespace, "deployments")["items"] == [], "no Redis on the old password"
    assert pods(cluster, namespace) == [], "no pods on the old password"

    hold_secret(cluster, namespace, None)
    wait_phase(cluster, namespace, "Running")
    uid = get(cluster, namespace, "colocatejob", "demo")["metadata"]["uid"]
    secret = get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]
    assert secret["uid"] != old_secret and [o["uid"] for o in secret["ownerReferences"]] == [uid]
    deployment = get(cluster, namespace, "deployment", "demo-metastore")["metadata"]
    assert [o["uid"] for o in deployment["ownerReferences"]] == [uid]
    assert deployment["creationTimestamp"] >= secret["creationTimestamp"]


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted(
    cluster, namespace: str, operator_identity
) -> None:
    """M8: a node nobody runs (no kubelet, no kwok) holds the job's pod; deleting it leaves it Terminating
    forever unless the operator deletes it with grace period 0 after its grace period."""
    node = f"lost-{namespace}"
    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": node,
                    "labels": {"kubernetes.io/hostname": node, "lost-test": namespace},
                },
                "status": {
                    "capacity": {"cpu": "8", "memory": "64Gi", "pods": "10", "nvidia.com/gpu": "8"},
                    "allocatable": {"cpu": "8", "memory": "64Gi", "pods": "10", "nvidia.com/gpu": "8"},
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                },
            }
        ]
    )
    operator = OperatorProcess(
        namespace,
        Path(cluster.log_dir) / f"operator-{namespace}.log",
        operator_identity,
        COLOCATE_FORCE_DELETE_AFTER_SECONDS="2",
    ).start()
    try:
        apply_job(
            cluster,
            namespace,
            numNodes=1,
            gpu={"allocation": "DevicePlugin"},
            pod={"terminationGracePeriodSeconds": 1},
            scheduling={"nodeSelector": {"lost-test": namespace}},
        )
        bound = wait_for(
            lambda: [p for p in pods(cluster, namespace) if p["spec"].get("nodeName") == node],
            60,
            f"the pod bound to {node}",
        )[0]
        cluster.kubectl(
            "patch",
            "colocatejob",
            "demo",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"spec": {"suspend": true}}',
        )
        wait_for(
            lambda: any(p["metadata"].get("deletionTimestamp") for p in pods(cluster, namespace)),
            30,
            "the pod Terminating",
        )
        wait_for(
            lambda: all(p["metadata"]["uid"] != bound["metadata"]["uid"] for p in pods(cluster, namespace)),
            30,
            "the stuck pod force-deleted",
        )
        forced = job_events(cluster, namespace, "ForceDeletedPod")
        assert forced and node in forced[0]["message"] and "grace period 0" in forced[0]["message"]
        assert job_status(cluster, namespace)["phase"] == "Suspended"
    finally:
        operator.stop()
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)


def test_unschedulable_pods_carry_the_schedulers_reason(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, gpu={"allocation": "DevicePlugin"}, gpusPerNode=16)  # nodes have 8
    allocated = condition_reason(cluster, namespace, "ResourcesAllocated", "Unschedulable")
    assert "nodes are available" in allocated["message"], allocated
    assert "Insufficient nvidia.com/gpu" in allocated["message"], allocated
    assert "Insufficient nvidia.com/gpu" in condition(job_status(cluster, namespace), "PodsReady")["message"]


def test_a_partly_placed_gang_gives_its_gpus_back_after_the_placement_timeout(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    """Five whole-node pods on four GPU nodes: four are placed and hold 32 GPUs for a fifth that can never
    come. After spec.scheduling.placementTimeoutSeconds the group lets go, saying why."""
    apply_job(
        cluster,
        namespace,
        numNodes=5,
        gpusPerNode=8,
        gpu={"allocation": "DevicePlugin"},
        scheduling={"placementTimeoutSeconds": 5},
        runPolicy={"maxRestarts": 0},
    )
    wait_for(
        lambda: sum(bool(p["spec"].get("nodeName")) for p in pods(cluster, namespace)) >= 1,
        60,
        "some pods placed",
    )
    status = wait_phase(cluster, namespace, "Failed", timeout=60)
    failed = condition(status, "Failed")
    assert "pods were placed within spec.scheduling.placementTimeoutSeconds=5" in failed["message"], failed
    assert "nodes are available" in failed["message"], failed
    wait_for(lambda: not pods(cluster, namespace) or None, 30, "every pod deleted, GPUs free")


def test_a_finished_training_is_not_restarted_when_the_operator_restarts_as_it_ends(
    cluster,
    namespace: str,
    operator_identity,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """M4: the trainer records its final step and the pods exit 0 while no operator runs. The restarted
    operator sees Succeeded pods before its step follower has replayed the stream: it must wait for the
    follower (catch-up barrier), not restart a finished training."""
    metastore_secret(cluster, namespace, redis_server)
    apply_job(cluster, namespace, gpusPerNode=1, metaStore=external_metastore(redis_server))
    first = OperatorProcess(namespace, tmp_path / "operator-1.log", operator_identity).start()
    try:
        wait_phase(cluster, namespace, "Running")
        running_pods(cluster, namespace, 2, 0)
    finally:
        first.kill()
    final = StepEvent(role="trainer", gen=1, step=7, phase="final", gpu="GPU-a", result="ok", final=True)
    xadd(redis_server.client(), stream_key(namespace, "demo"), final)
    for pod in ("demo-0", "demo-1"):
        patch = {"status": {"phase": "Succeeded", "reason": "Completed"}}
        patch_pod_status(cluster, namespace, pod, patch)
    assert not job_status(cluster, namespace).get("weightSync", {}).get("finalStepRecorded")

    # The meta-store answers slowly (paused): the restarted operator's first passes certainly come before its
    # follower has read anything.
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        second = OperatorProcess(namespace, tmp_path / "operator-2.log", operator_identity).start()
        waiting = condition_reason(cluster, namespace, "PodsReady", "WaitingForFinalRecord")
        assert "demo-0" in waiting["message"] or "demo-1" in waiting["message"]
        time.sleep(3)
        assert job_status(cluster, namespace)["restarts"] == 0
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    try:
        status = wait_phase(cluster, namespace, "Succeeded", timeout=90)
    finally:
        second.stop()
    assert status["restarts"] == 0
    assert condition(status, "Succeeded")["reason"] == "FinalStepRecorded"
    assert "RestartingGroup" not in job_event_reasons(cluster, namespace)
    assert [p["metadata"]["labels"]["colocate.dev/restart"] for p in pods(cluster, namespace)] == ["0", "0"]


def test_the_trainers_termination_message_finishes_the_job_without_the_stream(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    """M4, the stream lost (here: Redis never reachable, as after a Redis restart that dropped it): the
    trainer container's termination message carries the final record, and the job succeeds at once."""
    apply_job(cluster, namespace)
    wait_phase(cluster, namespace, "Running")
    message = final_termination_message(12)
    for pod in ("demo-0", "demo-1"):
        done = {"terminated": {"exitCode": 0, "reason": "Completed", "message": message}}
        patch = {
            "status": {
                "phase": "Succeeded",
                "containerStatuses": [
                    {
                        "name": "trainer",
                        "state": done,
                        "ready": False,
                        "restartCount": 0,
                        "image": "t",
                        "imageID": "",
                    },
                    {
                        "name": "rollout",
                        "state": done,
                        "ready": False,
                        "restartCount": 0,
                        "image": "s",
                        "imageID": "",
                    },
                ],
            }
        }
        patch_pod_status(cluster, namespace, pod, patch)
    status = wait_phase(cluster, namespace, "Succeeded", timeout=30)
    assert status["restarts"] == 0
    assert not status.get("weightSync", {}).get("finalStepRecorded"), "no follower read it"


def test_a_deleted_metastore_secret_restarts_redis_and_the_pods_on_the_new_password(
    cluster, namespace: str, operator_process: OperatorProcess
) -> None:
    apply_job(cluster, namespace, runPolicy={"backoffSeconds": 0})
    wait_phase(cluster, namespace, "Running")
    old_secret = get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"]
    redis = "colocate.dev/component=metastore"
    old_redis = {p["metadata"]["uid"] for p in get(cluster, namespace, "pods", "-l", redis)["items"]}
    cluster.kubectl("delete", "secret", "demo-metastore-auth", "-n", namespace)
    running_pods(cluster, namespace, 2, 1)
    status = wait_phase(cluster, namespace, "Running")
    assert status["restarts"] == 1
    assert condition(status, "Restarting")["reason"] == "GroupRunning"
    assert "MetaStorePasswordChanged" in job_event_reasons(cluster, namespace)
    assert get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"] != old_secret
    new_redis = wait_for(
        lambda: (
            {
                p["metadata"]["uid"]
                for p in get(cluster, namespace, "pods", "-l", redis)["items"]
                if not p["metadata"].get("deletionTimestamp")
            }
            - old_redis
        ),
        30,
        "a new Redis pod (it reads the password at start)",
    )
    assert new_redis and not old_redis & new_redis


def test_a_secret_from_before_the_worker_user_is_named_and_replaced_once_deleted(
    cluster,
    namespace: str,
    operator_process: OperatorProcess,
    operator_identity: ChartIdentity,
    tmp_path: Path,
) -> None:
    """An operator upgraded over a job whose Managed Secret has no `worker-password` (written before the
    worker user existed) says so in one Warning Event with the command to run (the chart grants no delete on
    Secrets); once the user deletes it, a new one with the key is made and the group restarts on it."""
    apply_job(cluster, namespace, runPolicy={"backoffSeconds": 0})
    wait_phase(cluster, namespace, "Running")
    operator_process.stop()
    current = get(cluster, namespace, "secret", "demo-metastore-auth")
    old = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "demo-metastore-auth",
            "labels": current["metadata"]["labels"],
            "ownerReferences": current["metadata"]["ownerReferences"],
        },
        "immutable": True,
        "data": {k: v for k, v in current["data"].items() if k != "worker-password"},
    }
    cluster.kubectl("delete", "secret", "demo-metastore-auth", "-n", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(old))
    old_uid = get(cluster, namespace, "secret", "demo-metastore-auth")["metadata"]["uid"]
    upgraded = OperatorProcess(namespace, tmp_path / "upgraded.log", operator_identity).start()
    try:
        wait_for(
            lambda: "MetaStoreSecretOutdated" in job_event_reasons(cluster, namespace),
            60,
            "a MetaStoreSecretOutdated Event",
        )
        events = get(cluster, namespace, "events", "--field-selector", "reason=MetaStoreSecretOutdated")
        assert len(events["items"]) == 1, "said once"
        assert f"kubectl delete secret demo-metastore-auth -n {namespace}" in events["items"][0]["message"]
        cluster.kubectl("delete", "secret", "demo-metastore-auth", "-n", namespace)
        status = wait_for(
            lambda: (
                (s := job_status(cluster, namespace)).get("restarts") == 1
                and s.get("phase") == "Running"
                and s
            ),
            90,
            "the group restarted on a new Secret",
        )
        secret = get(cluster, namespace, "secret", "demo-metastore-auth")
        assert secret["metadata"]["uid"] != old_uid and "worker-password" in secret["data"]
        assert secret["metadata"]["annotations"]["colocate.dev/secret-format"] == "2"
        assert "MetaStorePasswordChanged" in job_event_reasons(cluster, namespace)
        assert status["restarts"] == 1
    finally:
        upgraded.stop()
