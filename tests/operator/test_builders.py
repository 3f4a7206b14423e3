"""Pure manifest builders, table-driven: pods, headless Service, claim template, meta-store."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from colocate_operator import disruption, gpus, metastore, names, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import (
    CLAIM_NAME,
    KUEUE_QUEUE_LABEL,
    LABEL_REPLICA_INDEX,
    LABEL_RESTART,
)
from colocate_operator.spec import ColocateJob
from tests.operator import factories

CONFIG = OperatorConfig()
CONTRACT = {
    "COLOCATE_JOB_NAME",
    "COLOCATE_NAMESPACE",
    "COLOCATE_REPLICA_INDEX",
    "COLOCATE_NUM_NODES",
    "COLOCATE_GPUS_PER_NODE",
    "COLOCATE_RENDEZVOUS_ADDR",
    "COLOCATE_METASTORE_ADDR",
    "COLOCATE_METASTORE_PASSWORD",
    "COLOCATE_BUCKET_MB",
    "COLOCATE_STEP_TIMEOUT_SECONDS",
    "COLOCATE_TRANSPORT",
    "COLOCATE_TRAIN_TP",
    "COLOCATE_TRAIN_PP",
    "COLOCATE_TRAIN_EP",
    "COLOCATE_TRAIN_CP",
    "COLOCATE_INFER_TP",
    "COLOCATE_INFER_DP",
    "COLOCATE_INFER_EP",
    "COLOCATE_MODEL_ARCH",
    "COLOCATE_IPC_PREFLIGHT",
    "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS",
}


def build_pod(job: ColocateJob, index: int = 0, restart: int = 0) -> dict[str, Any]:
    return pods.pod(job, index, restart, metastore.endpoint(job, CONFIG), CONFIG)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_pod_layout_same_gpus_shared_shm_and_pid_namespace() -> None:
    pod = build_pod(factories.job(pod={"shmSize": "32Gi"}), index=1, restart=2)
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "demo-1"
    assert pod["metadata"]["labels"][LABEL_REPLICA_INDEX] == "1"
    assert pod["metadata"]["labels"][LABEL_RESTART] == "2"
    assert (spec["hostname"], spec["subdomain"]) == ("demo-1", "demo")
    assert spec["shareProcessNamespace"] is True
    assert spec["restartPolicy"] == "Never"
    assert spec["resourceClaims"] == [{"name": CLAIM_NAME, "resourceClaimTemplateName": "demo-gpus"}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert [c["name"] for c in spec["containers"]] == ["trainer", "rollout"]
    for container in spec["containers"]:
        assert container["resources"]["claims"] == [{"name": CLAIM_NAME}]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/dev/shm", "/run/colocate"} <= mounts
    assert "affinity" not in spec, "no anti-affinity: the scheduler pays for it with every pod (issue 35)"
    (spread,) = spec["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"colocate.dev/job": "demo", "colocate.dev/component": "worker"}},
        "minDomains": 2,  # numNodes: with fewer nodes to use, the pods that do not fit stay Pending
    }


def test_a_job_of_one_pod_needs_no_spread_constraint() -> None:
    assert "topologySpreadConstraints" not in build_pod(factories.job(numNodes=1))["spec"]


def test_sglang_probes_never_generate_so_they_stay_green_while_paused() -> None:
    trainer, rollout = build_pod(factories.job())["spec"]["containers"]
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(trainer)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rollout[kind]["tcpSocket"] == {"port": "http"} and "httpGet" not in rollout[kind], kind
    assert rollout["startupProbe"]["periodSeconds"] * rollout["startupProbe"]["failureThreshold"] >= 1800


def test_ipc_preflight_waits_by_default_in_both_containers() -> None:
    for container in build_pod(factories.job())["spec"]["containers"]:
        env = env_of(container)
        assert (env["COLOCATE_IPC_PREFLIGHT"], env["COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS"]) == (
            "Wait",
            "60",
        )


def test_env_contract_in_both_containers() -> None:
    job = factories.job(
        name="rl",
        namespace="team",
        numNodes=4,
        gpusPerNode=8,
        parallelism={
            "train": {"tensor": 4, "pipeline": 2, "expert": 2, "context": 1},
            "inference": {"tensor": 8, "data": 4, "expert": 8},
        },
        weightSync={
            "bucketMB": 256,
            "stepTimeoutSeconds": 120,
            "transport": "CudaIPC",
            "ipcPreflight": {"mode": "Fail", "timeoutSeconds": 30},
        },
        model={"arch": "qwen3_moe"},
    )
    pod = build_pod(job, index=3, restart=1)
    trainer, rollout = (env_of(c) for c in pod["spec"]["containers"])
    assert set(trainer) >= CONTRACT and set(rollout) >= CONTRACT
    expected = {
        "COLOCATE_JOB_NAME": "rl",
        "COLOCATE_NAMESPACE": "team",
        "COLOCATE_REPLICA_INDEX": "3",
        "COLOCATE_NUM_NODES": "4",
        "COLOCATE_GPUS_PER_NODE": "8",
        "COLOCATE_RENDEZVOUS_ADDR": "rl-0.rl.team.svc.cluster.local:29500",
        "COLOCATE_METASTORE_ADDR": "rl-metastore.team.svc.cluster.local:6379",
        "COLOCATE_BUCKET_MB": "256",
        "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
        "COLOCATE_TRANSPORT": "CudaIPC",
        "COLOCATE_TRAIN_TP": "4",
        "COLOCATE_TRAIN_PP": "2",
        "COLOCATE_TRAIN_EP": "2",
        "COLOCATE_TRAIN_CP": "1",
        "COLOCATE_INFER_TP": "8",
        "COLOCATE_INFER_DP": "4",
        "COLOCATE_INFER_EP": "8",
        "COLOCATE_MODEL_ARCH": "qwen3_moe",
        "COLOCATE_RESTART_COUNT": "1",
        "COLOCATE_IPC_PREFLIGHT": "Fail",
        "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS": "30",
    }
    for env in (trainer, rollout):
        assert {k: env[k] for k in expected} == expected
        assert env["COLOCATE_METASTORE_PASSWORD"] == {
            "secretKeyRef": {"name": "rl-metastore-auth", "key": "worker-password"}
        }
        assert env["COLOCATE_METASTORE_USERNAME"] == "colocate-worker"
    assert (trainer["COLOCATE_CONTAINER"], rollout["COLOCATE_CONTAINER"]) == ("trainer", "rollout")


@pytest.mark.parametrize(
    ("override", "addr", "secret"),
    [
        (
            {},
            "demo-metastore.ns.svc.cluster.local:6379",
            {"name": "demo-metastore-auth", "key": "worker-password"},
        ),
        (
            {
                "metaStore": {
                    "mode": "External",
                    "external": {
                        "address": "redis.shared:6380",
                        "passwordSecretRef": {"name": "shared-redis", "key": "pw"},
                    },
                }
            },
            "redis.shared:6380",
            {"name": "shared-redis", "key": "pw"},
        ),
    ],
    ids=["managed", "external"],
)
def test_metastore_address_and_password_reference(override: dict, addr: str, secret: dict) -> None:
    env = env_of(build_pod(factories.job(**override))["spec"]["containers"][0])
    assert env["COLOCATE_METASTORE_ADDR"] == addr
    assert env["COLOCATE_METASTORE_PASSWORD"] == {"secretKeyRef": secret}


def test_cluster_domain_and_ports_are_configurable() -> None:
    job = factories.job(trainer={"port": 23456}, rollout={"port": 8000})
    config = OperatorConfig(cluster_domain="corp.internal")
    pod = pods.pod(job, 0, 0, metastore.endpoint(job, config), config)
    env = env_of(pod["spec"]["containers"][1])
    assert env["COLOCATE_RENDEZVOUS_ADDR"] == "demo-0.demo.ns.svc.corp.internal:23456"
    assert env["COLOCATE_ROLLOUT_PORT"] == "8000"
    service = pods.headless_service(job)
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [8000, 23456]


def test_user_env_and_resources_come_after_the_contract() -> None:
    job = factories.job(
        trainer={
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
        }
    )
    trainer = build_pod(job)["spec"]["containers"][0]
    assert trainer["env"][-1] == {"name": "NCCL_DEBUG", "value": "INFO"}
    assert trainer["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert trainer["command"] == ["python", "-m", "train"]


@pytest.mark.parametrize(
    ("allocation", "trainer_gpus", "rollout_gpus", "claims", "rollout_visible"),
    [
        ("DRA", None, None, True, None),
        ("DevicePlugin", 8, None, False, "all"),
    ],
)
def test_gpu_allocation_modes(
    allocation: str,
    trainer_gpus: int | None,
    rollout_gpus: int | None,
    claims: bool,
    rollout_visible: str | None,
) -> None:
    job = factories.job(gpu={"allocation": allocation})
    pod = build_pod(job)
    trainer, rollout = pod["spec"]["containers"]
    assert trainer["resources"].get("limits", {}).get("nvidia.com/gpu") == trainer_gpus
    assert rollout["resources"].get("limits", {}).get("nvidia.com/gpu") == rollout_gpus
    assert ("resourceClaims" in pod["spec"]) is claims
    assert env_of(rollout).get("NVIDIA_VISIBLE_DEVICES") == rollout_visible
    assert (gpus.claim_template(job) is not None) is claims
    # The GPU taint is tolerated in both modes.
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["spec"]["tolerations"])


def test_claim_template_requests_gpus_per_node_of_the_device_class() -> None:
    job = factories.job(
        gpusPerNode=4,
        gpu={
            "deviceClassName": "gpu.example.com",
            "selectors": ['device.attributes["gpu.nvidia.com"].productName == "H200"'],
        },
    )
    template = gpus.claim_template(job)
    assert template is not None
    assert template["metadata"]["name"] == "demo-gpus"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == CLAIM_NAME
    assert request["exactly"]["deviceClassName"] == "gpu.example.com"
    assert request["exactly"]["count"] == 4
    assert request["exactly"]["allocationMode"] == "ExactCount"
    assert request["exactly"]["selectors"][0]["cel"]["expression"].startswith("device.attributes")


@pytest.mark.parametrize("queue", [None, "team-a"])
def test_worker_pods_carry_no_kueue_queue_label(queue: str | None) -> None:
    """A queued job is a Workload of its own (kueue.py): a queue label on its pods would have Kueue's pod
    integration queue them again, so none is set, and a user's copy of it in spec.pod.labels is dropped."""
    job = factories.job(
        scheduling={"queueName": queue} if queue else {}, pod={"labels": {KUEUE_QUEUE_LABEL: "other"}}
    )
    meta = build_pod(job)["metadata"]
    kueue_labels = {k: v for k, v in meta["labels"].items() if k.startswith("kueue.")}
    kueue_annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith("kueue.")}
    assert (kueue_labels, kueue_annotations) == ({}, {})


def test_scheduling_and_pod_options() -> None:
    job = factories.job(
        scheduling={
            "nodeSelector": {"pool": "h200"},
            "priorityClassName": "high",
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        },
        pod={
            "serviceAccountName": "rl",
            "labels": {"team": "a"},
            "annotations": {"note": "x"},
            "terminationGracePeriodSeconds": 5,
        },
    )
    pod = build_pod(job)
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "h200"}
    assert spec["priorityClassName"] == "high"
    assert spec["serviceAccountName"] == "rl"
    assert spec["terminationGracePeriodSeconds"] == 5
    assert {"key": "dedicated", "operator": "Exists"} in spec["tolerations"]
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["annotations"] == {"note": "x"}


def test_headless_service_publishes_not_ready_addresses() -> None:
    service = pods.headless_service(factories.job())
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == "demo"


def test_headless_service_selects_the_rendezvous_pod_alone() -> None:
    """Pod 0 is the only name dialled (COLOCATE_RENDEZVOUS_ADDR); its hostname and subdomain match."""
    job = factories.job(numNodes=4)
    selector = pods.headless_service(job)["spec"]["selector"]
    matched = [
        pod["metadata"]["name"]
        for pod in (build_pod(job, index) for index in range(4))
        if selector.items() <= pod["metadata"]["labels"].items()
    ]
    assert matched == ["demo-0"]
    rendezvous = build_pod(job, 0)
    assert (rendezvous["spec"]["hostname"], rendezvous["spec"]["subdomain"]) == ("demo-0", "demo")


def test_metastore_password_only_in_the_secret() -> None:
    job = factories.job()
    password = "s3cr3t-Pa55word-for-the-test"
    secret, deployment, service, policy = metastore.managed_children(job, CONFIG, password)
    assert secret["stringData"]["password"] == password
    # Redis holds only digests of the operator's and the worker's passwords (test_metastore_acl.py).
    assert password not in secret["stringData"]["redis.conf"]
    assert hashlib.sha256(password.encode()).hexdigest() in secret["stringData"]["redis.conf"]
    for other in (
        deployment,
        service,
        policy,
        build_pod(job),
        pods.headless_service(job),
        gpus.claim_template(job),
    ):
        assert password not in json.dumps(other)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["redis-server", "/etc/colocate-redis/redis.conf"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize(
    ("operator_namespace", "peers"),
    [(None, 1), ("colocate-system", 2)],
)
def test_network_policy_admits_only_the_jobs_pods_and_the_operator(
    operator_namespace: str | None, peers: int
) -> None:
    policy = metastore.network_policy(factories.job(), OperatorConfig(operator_namespace=operator_namespace))
    (rule,) = policy["spec"]["ingress"]
    assert len(rule["from"]) == peers
    assert rule["from"][0] == {
        "podSelector": {"matchLabels": {"colocate.dev/job": "demo", "colocate.dev/component": "worker"}}
    }
    assert policy["spec"]["podSelector"]["matchLabels"]["colocate.dev/component"] == "metastore"
    if operator_namespace:
        assert rule["from"][1]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": operator_namespace
        }


def test_external_metastore_has_no_managed_children() -> None:
    job = factories.job(
        metaStore={"mode": "External", "external": {"address": "r:6379", "passwordSecretRef": {"name": "s"}}}
    )
    assert metastore.managed_children(job, CONFIG, "pw") == []


def test_every_child_is_owned_by_the_job() -> None:
    job = factories.job()
    children = [
        *metastore.managed_children(job, CONFIG, "pw"),
        gpus.claim_template(job),
        pods.headless_service(job),
        pods.network_policy(job),
        disruption.budget(job),
        *pods.pods(job, 0, metastore.endpoint(job, CONFIG), CONFIG),
    ]
    for child in children:
        assert child is not None
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "colocate.dev/v1alpha1",
            "kind": "ColocateJob",
            "name": "demo",
            "uid": "uid-demo",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["labels"]["colocate.dev/job"] == "demo"


def test_longest_job_name_fits_every_child_name() -> None:
    job = "j" * 40
    for child in (
        names.metastore_secret(job),
        names.metastore(job),
        names.claim_template(job),
        names.pod(job, 255),
    ):
        assert len(child) <= 63


def test_worker_network_policy_admits_only_the_jobs_own_pods_on_every_port() -> None:
    """No port list: NCCL and gloo open ports between ranks that are not known in advance."""
    job = factories.job(trainer={"port": 23456}, rollout={"port": 8000})
    policy = pods.network_policy(job)
    workers = {"matchLabels": {"colocate.dev/job": "demo", "colocate.dev/component": "worker"}}
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["name"] == "demo-workers"
    assert policy["spec"]["podSelector"] == workers
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": workers}]}]
    # The policy selects exactly the pods that carry the ports.
    pod_labels = build_pod(job)["metadata"]["labels"]
    assert workers["matchLabels"].items() <= pod_labels.items()
    assert names.worker_network_policy("j" * 40) != names.metastore("j" * 40)


def test_pods_pass_pod_security_restricted_by_default() -> None:
    spec = build_pod(factories.job())["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    for container in spec["containers"]:
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    assert not {"hostIPC", "hostPID", "hostNetwork"} & set(spec)


def test_security_context_fields_replace_the_defaults_one_by_one() -> None:
    job = factories.job(
        pod={"securityContext": {"runAsUser": 1000, "fsGroup": 1000}, "automountServiceAccountToken": True},
        rollout={
            "securityContext": {"readOnlyRootFilesystem": True, "capabilities": {"add": ["SYS_PTRACE"]}}
        },
    )
    spec = build_pod(job)["spec"]
    assert spec["automountServiceAccountToken"] is True
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1000,
        "fsGroup": 1000,
    }
    trainer, rollout = spec["containers"]
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert rollout["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"add": ["SYS_PTRACE"]},
        "readOnlyRootFilesystem": True,
    }


def test_api_key_from_its_secret_in_both_containers_never_on_a_command_line() -> None:
    job = factories.job(rollout={"apiKeySecretRef": {"name": "sglang-auth", "key": "token"}})
    pod = build_pod(job)
    for container in pod["spec"]["containers"]:
        assert env_of(container)["SGLANG_API_KEY"] == {
            "secretKeyRef": {"name": "sglang-auth", "key": "token"}
        }
        assert not any(
            "SGLANG_API_KEY" in a for a in [*container.get("command", []), *container.get("args", [])]
        )
    assert "SGLANG_API_KEY" not in json.dumps(build_pod(factories.job()))


@pytest.mark.parametrize("allocation", ["DRA", "DevicePlugin"])
def test_user_nvidia_visible_devices_never_reaches_a_container(allocation: str) -> None:
    """The CRD refuses it; the builder drops it too, for a cluster whose CRD is older than the operator."""
    widen = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "SGLANG_API_KEY", "value": "x"}]
    job = factories.job(gpu={"allocation": allocation}, trainer={"env": widen}, rollout={"env": widen})
    trainer, rollout = build_pod(job)["spec"]["containers"]
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(trainer)
    assert "SGLANG_API_KEY" not in env_of(trainer)
    # DevicePlugin: the one operator-set value (module doc of gpus.py says why); DRA: none.
    visible = [e for e in rollout["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
    assert visible == (
        [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}] if allocation == "DevicePlugin" else []
    )


def test_privileged_fields_are_named_and_a_privileged_container_may_escalate() -> None:
    """Issue 30, item 4: what the operator checks against its privileged namespaces (the CRD refuses the
    same fields unless spec.pod.allowPrivileged)."""
    job = factories.job(
        trainer={"securityContext": {"privileged": True, "capabilities": {"add": ["NET_BIND_SERVICE"]}}},
        rollout={"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}, "runAsUser": 0}},
        pod={"allowPrivileged": True, "securityContext": {"seccompProfile": {"type": "Unconfined"}}},
    )
    assert pods.privileged_fields(job.spec) == [
        "spec.trainer.securityContext.privileged",
        "spec.rollout.securityContext.capabilities.add",
        "spec.rollout.securityContext.runAsUser",
        "spec.pod.securityContext.seccompProfile",
    ]
    assert pods.privileged_fields(factories.job().spec) == []
    merged = pods.security_context({"allowPrivilegeEscalation": False}, {"privileged": True})
    assert merged == {"privileged": True}, "the API server refuses privileged without escalation"
    config = OperatorConfig(privileged_namespaces=frozenset({"team-a"}))
    assert config.allows_privileged("team-a") and not config.allows_privileged("team-b")
    assert OperatorConfig(privileged_namespaces=frozenset({"*"})).allows_privileged("any")
    assert not OperatorConfig().allows_privileged("team-a")
