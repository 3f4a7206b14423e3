"""A ColocateJob on real containers: the chart's operator (a container on the real node, its ServiceAccount's
RBAC only) reconciles a job whose Redis, trainer and SGLang stand-in all run as real containers on the real
node, from the images `make images` built, in a namespace that enforces Pod Security "restricted". The
trainer gets its GPU from the node's fake device plugin through the kubelet and completes weight-update
steps into the stand-in over the pod's shared /dev/shm (the CPU stand-in for CUDA IPC). After the first step
the SGLang container's process is SIGKILLed (containerd, as an OOM kill would end it): the kubelet restarts
that container alone, in the same pod, and the trainer, never restarted, pushes its current weights to the new
engine, bit for bit. Its final record reaches the pod's status as its termination message and the job ends
Succeeded although the stand-in, like an SGLang server, never exits by itself: the operator ends the job and
deletes the pod.

Stand-ins, named: the node's GPUs come from a fake device plugin (devcluster/fakegpu: NVIDIA_VISIBLE_DEVICES
names a fake device, no device node), so the job uses gpu.allocation DevicePlugin; the node's DNS answers
Service names with pod IPs (no CoreDNS, no kube-proxy: colocate_devcluster.dns); the containers' commands set
COLOCATE_TRANSPORT=SharedMemory themselves, since the CRD allows only CudaIPC and reserves COLOCATE_* in spec
env."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.realnode import GPU_ENV, GPU_ID_PREFIX, dedicate, node_name
from colocate_runtime.contract.events import is_final_termination_message
from demo import realnode_demo
from demo.realnode_demo import REDIS_IMAGE, RUNTIME_IMAGE
from tests.kube import get_json, wait_for

# The first test of the tier builds the images when their inputs changed (scripts/build-images.sh: minutes
# on a loaded machine after a source change) and starts the real node: beyond the suite's default timeout.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1500),
]

STEPS = 3
KILL_AFTER = 1  # the SGLang container is killed once the trainer logged this step
STEP_SECONDS = 3  # the trainer's pace: the kill lands well before its last step


def job_manifest(namespace: str) -> dict[str, Any]:
    """What `make demo DEMO_ARGS=--real-node` applies (examples/colocatejob.yaml on the real node), slower."""
    return realnode_demo.job_manifest("rn", namespace, STEPS, STEP_SECONDS)


_records = realnode_demo.records
_container_status = realnode_demo.container_status


@pytest.fixture(scope="module")
def finished_job(real_cluster: Cluster, operator_namespace: str, job_namespace: str) -> dict[str, Any]:
    """The job run to its end, its SGLang container killed after step KILL_AFTER; what was seen on the way
    (pods as they ran, the trainer's log, the kill, the rollout container when the trainer had exited)."""
    dedicate(real_cluster.kubectl)  # from now on every new pod lands on the real node, Redis included
    node = real_cluster.real_nodes[0]
    namespace = job_namespace  # enforces Pod Security "restricted"; the operator manages it
    real_cluster.apply([job_manifest(namespace)])
    applied = time.monotonic()
    seen: dict[str, Any] = {"namespace": namespace, "pods": {}, "trainer_log": "", "killed": None}

    def observe() -> None:
        for pod in get_json(real_cluster, "pods", "-n", namespace)["items"]:
            name = pod["metadata"]["name"]
            seen["pods"][name] = pod
            trainer = _container_status(pod, "trainer")
            if not trainer or "metastore" in name:
                continue
            if "terminated" in trainer.get("state", {}):
                if not seen["trainer_log"]:
                    logs = real_cluster.kubectl("logs", name, "-c", "trainer", "-n", namespace, check=False)
                    seen["trainer_log"] = logs.stdout
                    seen["rollout_when_trainer_exited"] = _container_status(pod, "rollout")
                    seen["trainer_terminated"] = trainer["state"]["terminated"]
            elif seen["killed"] is None and "running" in trainer.get("state", {}):
                logs = real_cluster.kubectl("logs", name, "-c", "trainer", "-n", namespace, check=False)
                if any(r.get("step") == KILL_AFTER for r in _records(logs.stdout)):
                    rollout = _container_status(pod, "rollout")
                    assert rollout and "running" in rollout["state"], rollout
                    node.kill_container(rollout["containerID"])
                    seen["killed"] = {"pod_uid": pod["metadata"]["uid"], "container": rollout["containerID"]}
                    print(f"\n[job] SGLang container killed {time.monotonic() - applied:.1f} s after apply")

    deadline = time.monotonic() + 300
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        observe()
        status = get_json(real_cluster, "colocatejob", "rn", "-n", namespace).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            seen["status"] = status
            observe()  # the pods as the operator saw them when it decided (deleted only after a grace period)
            print(f"[job] {status['phase']} {time.monotonic() - applied:.1f} s after apply")
            return seen
        time.sleep(1)
    pods = {n: p.get("status") for n, p in seen["pods"].items()}
    raise AssertionError(f"the job did not finish in 300 s: {status}\npods: {json.dumps(pods)[-4000:]}")


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
    steps = [r for r in _records(finished_job["trainer_log"]) if "step" in r]
    assert [s.get("step") for s in steps] == list(range(1, STEPS + 1)), finished_job["trainer_log"][-3000:]
    assert all(s["rollout_matches_trainer"] and s["bytes"] > 0 for s in steps), steps


def test_the_trainer_got_its_gpu_from_the_device_plugin(finished_job: dict[str, Any]) -> None:
    first = finished_job["trainer_log"].splitlines()[0]
    assert first.startswith(f"{GPU_ENV}={GPU_ID_PREFIX}"), finished_job["trainer_log"][:500]


def test_a_killed_sglang_container_restarts_in_place_and_the_weights_are_pushed_again(
    finished_job: dict[str, Any],
) -> None:
    killed = finished_job["killed"]
    assert killed, f"the trainer never logged step {KILL_AFTER} while running"
    (pod,) = [p for n, p in finished_job["pods"].items() if "metastore" not in n]
    assert pod["metadata"]["uid"] == killed["pod_uid"]  # the same pod: no group restart
    rollout = _container_status(pod, "rollout")
    assert rollout["restartCount"] == 1, rollout  # the kubelet restarted it, alone
    assert rollout["lastState"]["terminated"]["exitCode"] == 137, rollout
    assert rollout["containerID"] != killed["container"], rollout
    assert _container_status(pod, "trainer")["restartCount"] == 0
    records = _records(finished_job["trainer_log"])
    repushed = [r for r in records if "repushed" in r]
    # Once, the last step the trainer had installed (or the next, had the kill come after its publish),
    # bit for bit, and no training step was lost or repeated.
    assert len(repushed) == 1, records
    assert repushed[0]["repushed"] in (KILL_AFTER, KILL_AFTER + 1) and repushed[0]["bitwise"] is True, (
        repushed
    )
    assert not [r for r in records if "error" in r], records
    status = finished_job["status"]
    assert status.get("engineRestarts") == 1 and status.get("restarts", 0) == 0, status


def test_the_job_succeeds_and_its_pod_goes_although_sglang_never_exits(
    real_cluster: Cluster, finished_job: dict[str, Any]
) -> None:
    assert finished_job["status"]["phase"] == "Succeeded", finished_job["status"]
    # The stand-in still served when the trainer had gone: nothing but the operator ended it. This test looks
    # once a second, and on a loaded machine the operator's delete of the finished pod can come first: then
    # the container was ended by that delete (SIGTERM 143, or SIGKILL 137 after the grace period), no sooner
    # than the trainer's exit.
    rollout = finished_job["rollout_when_trainer_exited"]
    assert rollout, finished_job["pods"]
    ended = rollout["state"].get("terminated")
    if ended is None:
        assert "running" in rollout["state"], rollout
    else:
        trainer_exit = finished_job["trainer_terminated"]["finishedAt"]
        assert ended["exitCode"] in (137, 143) and ended["finishedAt"] >= trainer_exit, (
            rollout,
            trainer_exit,
        )
    namespace = finished_job["namespace"]

    def workers() -> list[str]:
        pods = get_json(real_cluster, "pods", "-n", namespace)["items"]
        return [p["metadata"]["name"] for p in pods if "metastore" not in p["metadata"]["name"]]

    wait_for(lambda: not workers(), 60, "the operator to delete the worker pod whose SGLang still served")


def test_trainer_termination_message_reaches_status(finished_job: dict[str, Any]) -> None:
    workers = [p for n, p in finished_job["pods"].items() if "metastore" not in n]
    # The trainer's terminated state as first seen (the pod is deleted after the job ends).
    terminated = _container_status(workers[0], "trainer")["state"]["terminated"]
    assert terminated["exitCode"] == 0, terminated
    assert is_final_termination_message(terminated.get("message")), terminated
    assert json.loads(terminated["message"])["step"] == STEPS
