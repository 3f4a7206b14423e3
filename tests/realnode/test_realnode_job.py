"""A ColocateJob on real containers: the chart's operator (a container on the real node, its ServiceAccount's
RBAC only) reconciles a job whose Redis, trainer and SGLang stand-in all run as real containers on the real
node, from the images `make images` built, in a namespace that enforces Pod Security "restricted". The
trainer completes weight-update steps into the stand-in over the pod's shared /dev/shm (the CPU stand-in
for CUDA IPC), and its final record reaches the pod's status as its termination message; the stand-in then
leaves (ROLLOUT below) and the job ends Succeeded.

Stand-ins, named: the node's GPUs are an extended resource with no device behind it (realnode.advertise_gpus,
so the job uses gpu.allocation DevicePlugin); the node's DNS answers Service names with pod IPs (no CoreDNS,
no kube-proxy: colocate_devcluster.dns); the containers' commands set COLOCATE_TRANSPORT=SharedMemory
themselves, since the CRD allows only CudaIPC and reserves COLOCATE_* in spec env."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.realnode import REAL_NODE_LABEL, REAL_NODE_TOLERATION, dedicate, node_name
from colocate_runtime.contract.events import is_final_termination_message
from tests.kube import get_json
from tests.realnode.conftest import SLOW

# The first test of the tier builds the images when their inputs changed (scripts/build-images.sh: minutes
# on a loaded machine after a source change) and starts the real node: beyond the suite's default timeout.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1500),
    # Slow set: about 3.5 min more than the node tier (the 1.3 GB worker image built and imported), out of
    # `make test`'s budget: COLOCATE_SLOW_TESTS=1 .venv/bin/python -m pytest tests/realnode
    pytest.mark.skipif(not SLOW, reason="slow set: set COLOCATE_SLOW_TESTS=1"),
]

RUNTIME_IMAGE = "localhost/colocate-runtime:0.1.0"  # scripts/build-images.sh
REDIS_IMAGE = "localhost/colocate-redis:7.0-bookworm"
STEPS = 2
SHM = "COLOCATE_TRANSPORT=SharedMemory"  # the CPU path; the CRD's transport is CudaIPC only
LOADER = "colocate_runtime.sglang.loader.load_colocated_step colocate_runtime.sglang.loader.start_colocated"
# The SGLang stand-in, which leaves once the trainer has: the operator ends a job Succeeded only when every
# container exited after the final record, and an SGLang server (real or stand-in) serves on by itself. The
# pod shares one process namespace, so the rollout container sees the trainer's process come and go
# (`traine[r]`: the pattern must not match this script's own command line).
ROLLOUT = f"""{SHM} python -m colocate_runtime.sglang.standin \\
  --host 0.0.0.0 --port "$COLOCATE_ROLLOUT_PORT" --custom-weight-loader {LOADER} &
server=$!
trainer() {{ grep -qs 'demo/traine[r][.]py' /proc/[0-9]*/cmdline; }}
until trainer; do sleep 0.5; done
while trainer; do sleep 0.5; done
kill $server; wait $server; exit 0
"""


def job_manifest(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "colocate.dev/v1alpha1",
        "kind": "ColocateJob",
        "metadata": {"name": "rn", "namespace": namespace},
        "spec": {
            "numNodes": 1,
            "gpusPerNode": 1,
            "model": {"arch": "qwen3"},
            "gpu": {"allocation": "DevicePlugin"},
            "scheduling": {"nodeSelector": {REAL_NODE_LABEL: "true"}, "tolerations": [REAL_NODE_TOLERATION]},
            "trainer": {
                "image": RUNTIME_IMAGE,
                "command": ["sh", "-c", f"{SHM} exec python demo/trainer.py"],
                "env": [
                    {"name": "DEMO_STEPS", "value": str(STEPS)},
                    {"name": "DEMO_STEP_SECONDS", "value": "0"},
                ],
            },
            "rollout": {"image": RUNTIME_IMAGE, "command": ["sh", "-c", ROLLOUT]},
            "metaStore": {"image": REDIS_IMAGE},  # Managed: the operator makes the job's Redis
            "weightSync": {"stepTimeoutSeconds": 60},
        },
    }


@pytest.fixture(scope="module")
def finished_job(real_cluster: Cluster, operator_namespace: str, job_namespace: str) -> dict[str, Any]:
    """The job run to its end; what was seen on the way (pods as they ran, the trainer's log)."""
    dedicate(real_cluster.kubectl)  # from now on every new pod lands on the real node, Redis included
    namespace = job_namespace  # enforces Pod Security "restricted"; the operator manages it
    real_cluster.apply([job_manifest(namespace)])
    seen: dict[str, Any] = {"namespace": namespace, "pods": {}, "trainer_log": ""}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for pod in get_json(real_cluster, "pods", "-n", namespace)["items"]:
            seen["pods"][pod["metadata"]["name"]] = pod
            trainer = _container_status(pod, "trainer")
            if trainer and "terminated" in trainer.get("state", {}) and not seen["trainer_log"]:
                name = pod["metadata"]["name"]
                logs = real_cluster.kubectl("logs", name, "-c", "trainer", "-n", namespace, check=False)
                seen["trainer_log"] = logs.stdout
        status = get_json(real_cluster, "colocatejob", "rn", "-n", namespace).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            seen["status"] = status
            return seen
        time.sleep(1)
    pods = {n: p.get("status") for n, p in seen["pods"].items()}
    raise AssertionError(f"the job did not finish in 180 s: {status}\npods: {json.dumps(pods)[-4000:]}")


def _container_status(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return next((c for c in statuses if c["name"] == name), None)


def test_the_jobs_redis_runs_as_a_real_container_on_the_real_node(finished_job: dict[str, Any]) -> None:
    redis = [p for n, p in finished_job["pods"].items() if "metastore" in n]
    assert redis, list(finished_job["pods"])
    pod = redis[-1]
    assert pod["spec"]["nodeName"] == node_name(0)
    status = _container_status(pod, "redis")
    assert status and status["containerID"].startswith("containerd://") and status["ready"], status
    assert status["image"].endswith(REDIS_IMAGE.split("/", 1)[1])


def test_worker_pod_runs_real_containers_under_pod_security_restricted(
    real_cluster: Cluster, finished_job: dict[str, Any]
) -> None:
    workers = [p for n, p in finished_job["pods"].items() if "metastore" not in n]
    assert len(workers) == 1, list(finished_job["pods"])
    (pod,) = workers
    assert pod["spec"]["nodeName"] == node_name(0)
    for name in ("trainer", "rollout"):
        status = _container_status(pod, name)
        assert status and status["containerID"].startswith("containerd://"), status
    # The namespace enforces "restricted": the job's pods were admitted, and a pod that breaks it is not.
    bad = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": finished_job["namespace"]},
        "spec": {
            "containers": [{"name": "c", "image": RUNTIME_IMAGE, "securityContext": {"privileged": True}}]
        },
    }
    refused = real_cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


def test_steps_complete_over_shared_memory(finished_job: dict[str, Any]) -> None:
    status = finished_job["status"]
    assert status["phase"] == "Succeeded", status
    assert status["weightSync"]["lastCompletedStep"] == STEPS, status["weightSync"]
    steps = [json.loads(line) for line in finished_job["trainer_log"].splitlines() if line.startswith("{")]
    assert [s.get("step") for s in steps] == list(range(1, STEPS + 1)), finished_job["trainer_log"][-3000:]
    assert all(s["rollout_matches_trainer"] and s["bytes"] > 0 for s in steps), steps


def test_trainer_termination_message_reaches_status(finished_job: dict[str, Any]) -> None:
    workers = [p for n, p in finished_job["pods"].items() if "metastore" not in n]
    terminated = _container_status(workers[0], "trainer")["state"]["terminated"]
    assert terminated["exitCode"] == 0, terminated
    assert is_final_termination_message(terminated.get("message")), terminated
    assert json.loads(terminated["message"])["step"] == STEPS
