"""`make demo DEMO_ARGS=--real-node`: the demo on real containers, and what the slow real-node tests share.

The images built here (scripts/build-images.sh); a local control plane whose one schedulable node is a real
kubelet with containerd (devcluster/realnode.py); the Helm chart, its operator Deployment running on that node
from localhost/colocate-operator (pullPolicy Never, its probes green, its ServiceAccount's RBAC only); then
examples/colocatejob.yaml, adapted to the node: one pod on it, Managed meta-store (the operator's Redis, from
localhost/colocate-redis), trainer and SGLang stand-in from localhost/colocate-runtime, in a namespace that
enforces Pod Security "restricted". Every step shows up in `kubectl get colocatejobs` as in the quick demo.

Stand-ins, named: the node's GPUs come from a fake device plugin (gpu.allocation DevicePlugin); the
containers' commands set COLOCATE_TRANSPORT=SharedMemory themselves (the CPU stand-in for CUDA IPC: the CRD
takes only CudaIPC and reserves COLOCATE_* in spec env); the SGLang container runs the stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.realnode import (
    GPU_ENV,
    REAL_NODE_LABEL,
    REAL_NODE_TOLERATION,
    can_run,
    dedicate,
    images_dir,
    node_name,
)

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_REPOSITORY = (
    "localhost/colocate-operator"  # what scripts/build-images.sh tags, the chart's appVersion
)
RUNTIME_IMAGE = "localhost/colocate-runtime:0.1.0"
REDIS_IMAGE = "localhost/colocate-redis:7.0-bookworm"
SHM = "COLOCATE_TRANSPORT=SharedMemory"  # the CPU path; the CRD's transport is CudaIPC only
LOADER = "colocate_runtime.sglang.loader.load_colocated_step colocate_runtime.sglang.loader.start_colocated"
# The SGLang stand-in as the container's own process: it serves until it is stopped, as a server does.
ROLLOUT = (
    f'{SHM} exec python -m colocate_runtime.sglang.standin --host 0.0.0.0 --port "$COLOCATE_ROLLOUT_PORT" '
    f"--custom-weight-loader {LOADER}"
)
# The trainer says which GPU the device plugin gave it (not a JSON line: readers take those as records).
TRAINER = f'echo "{GPU_ENV}=${GPU_ENV}"; {SHM} exec python demo/trainer.py'
# Pod Security "restricted", enforced: the namespace of the job on real containers.
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}
ON_REAL_NODE = (
    "--set-json", f'nodeSelector={{"{REAL_NODE_LABEL}":"true"}}',
    "--set-json", f"tolerations={json.dumps([REAL_NODE_TOLERATION])}",
)  # fmt: skip
NAMESPACE = "demo"
OPERATOR_NAMESPACE = "colocate-system"
RELEASE = "colocate-operator"


def chart_values(watch_namespace: str) -> list[str]:
    """helm options: the operator from the image built here, pinned to the real node, managing one namespace
    (the chart's default RBAC: a Role there, nothing cluster-wide but reads)."""
    return [
        "--set", f"image.repository={OPERATOR_REPOSITORY}", "--set", "image.pullPolicy=Never",
        "--set", f"watchNamespaces={{{watch_namespace}}}", *ON_REAL_NODE,
    ]  # fmt: skip


def job_manifest(name: str, namespace: str, steps: int, step_seconds: float) -> dict[str, Any]:
    """examples/colocatejob.yaml on the real node: one pod selecting and tolerating it, its GPU from the
    device plugin, the images built here, the Managed meta-store (the operator's Redis), the containers'
    commands on the shared-memory transport, `steps` trainer steps `step_seconds` apart."""
    job = yaml.safe_load((ROOT / "examples" / "colocatejob.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    spec = job["spec"]
    spec.update(
        numNodes=1,  # one real node (a job keeps one pod a node: colocate_operator/placement.py)
        gpu={"allocation": "DevicePlugin"},
        scheduling={"nodeSelector": {REAL_NODE_LABEL: "true"}, "tolerations": [REAL_NODE_TOLERATION]},
        metaStore={"image": REDIS_IMAGE},  # Managed: the operator makes the job's Redis
    )
    spec["trainer"] = {
        "image": RUNTIME_IMAGE,
        "command": ["sh", "-c", TRAINER],
        "env": [
            {"name": "DEMO_STEPS", "value": str(steps)},
            {"name": "DEMO_STEP_SECONDS", "value": str(step_seconds)},
        ],
    }
    spec["rollout"] = {"image": RUNTIME_IMAGE, "command": ["sh", "-c", ROLLOUT]}
    spec["weightSync"]["stepTimeoutSeconds"] = 60
    return job


def build_images(with_runtime: bool = True, echo: Callable[[str], None] | None = None) -> list[str]:
    """scripts/build-images.sh (cached: seconds when nothing changed, about 10 min cold); each of its
    progress lines to `echo` as it comes. Its stderr lines; raises RuntimeError when it fails."""
    env = {**os.environ, "COLOCATE_RUNTIME_IMAGE": "1" if with_runtime else "0"}
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "build-images.sh")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if echo:
            echo(lines[-1])
    if proc.wait() != 0:
        raise RuntimeError("scripts/build-images.sh failed:\n" + "\n".join(lines[-40:]))
    return lines


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return next((c for c in statuses if c["name"] == name), None)


def records(log: str) -> list[dict[str, Any]]:
    """The trainer's JSON lines (one per step, and a `repushed` line after an engine restart)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


# -- the demo ---------------------------------------------------------------------------------------------
STEP_SECONDS = 2.0  # the trainer's pace between steps: each shows in `kubectl get` (polled)
PODS_TIMEOUT = 300.0  # apply to every container running (Redis, the trainer's torch import on 2 cores)
STEP_TIMEOUT = 60.0
StepTable = Callable[[dict[str, Any], dict[str, list[dict[str, Any]]]], None]


def say(message: str) -> None:
    print(f"\n\033[1m== {message}\033[0m", flush=True)


def main(args: argparse.Namespace, step_table: StepTable) -> int:
    """The demo on real containers (demo/run.py --real-node); `step_table` prints the steps' summary."""
    why = can_run()
    if why:
        raise SystemExit(f"demo --real-node: this machine cannot run a real node: {why}")
    if (args.workdir / "state.json").exists() and Cluster.load(args.workdir).any_alive():
        raise SystemExit(
            f"demo: a cluster from {args.workdir} is still running (--keep); stop it with `make cluster-down "
            f"COLOCATE_DEVCLUSTER_DIR={args.workdir}`"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still tears everything down
    started = time.monotonic()
    say("1/7 the images, built here (scripts/build-images.sh: seconds when cached, about 10 min cold)")
    try:
        build_images(echo=lambda line: print(f"   {line}", flush=True))
    except RuntimeError as err:
        raise SystemExit(f"demo --real-node: {err}") from None
    times = {"images": time.monotonic() - started}
    shutil.rmtree(args.workdir, ignore_errors=True)
    with ExitStack() as stack:
        cluster = _bring_up(stack, args)
        times["cluster, node and chart"] = time.monotonic() - started - sum(times.values())
        say(f"4/7 kubectl apply: examples/colocatejob.yaml on {node_name(0)}, Pod Security restricted")
        job = job_manifest("demo", NAMESPACE, args.steps, STEP_SECONDS)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
        print(_wait_running(cluster), end="")

        say(f"5/7 {args.steps} weight-update steps, each in `kubectl get colocatejobs`")
        seen, status = _follow(cluster, "demo", args.steps)
        times["job, apply to end"] = time.monotonic() - started - sum(times.values())

        say("6/7 the pods and containers that ran: real containers on a real kubelet")
        print(
            "kubectl get pods -A -o wide, when the job's containers were Ready (or done):\n"
            + seen["pods_text"]
        )
        operator = _get(cluster, "pods", "-n", OPERATOR_NAMESPACE)["items"]
        _containers_table([*operator, *seen["pods"].values()])

        say("7/7 summary")
        results = {"0": records(seen["trainer_log"])}
        step_table(status, results)
        steps = [r for r in results["0"] if "step" in r]
        ok = (
            status.get("phase") == "Succeeded"
            and len(steps) == args.steps
            and all(r.get("rollout_matches_trainer") for r in steps)
        )
        spent = ", ".join(f"{what} {seconds:.0f} s" for what, seconds in times.items())
        print(f"\ndemo {'succeeded' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s ({spent}); "
              f"node logs in {args.workdir / node_name(0)}")  # fmt: skip
        if args.keep:
            print(
                f"cluster left running: export KUBECONFIG={cluster.kubeconfig}; stop with `make cluster-down "
                f"COLOCATE_DEVCLUSTER_DIR={args.workdir}`"
            )
        return 0 if ok else 1


def _bring_up(stack: ExitStack, args: argparse.Namespace) -> Cluster:
    """Steps 2 and 3: the cluster with its real node, the only schedulable one; the chart's operator there."""
    say("2/7 a local control plane and a real node: kubelet, containerd, runc, CNI (images imported)")
    cluster = Cluster(ClusterSpec(workdir=args.workdir, gpu_nodes=0, real_nodes=1)).start()
    if not args.keep:
        # The node's containerd store (the images unpacked, GBs) goes after teardown; its logs stay.
        stack.callback(shutil.rmtree, args.workdir / node_name(0) / "containerd", ignore_errors=True)
        stack.callback(cluster.stop)
    _ensure_imported(cluster, RUNTIME_IMAGE)
    dedicate(cluster.kubectl)  # the only schedulable node: the operator's Redis lands there too
    print(cluster.kubectl("get", "nodes", "-o", "wide").stdout, end="")

    say(f"3/7 helm install {RELEASE}: its Deployment on {node_name(0)} from {OPERATOR_REPOSITORY}")
    _install_chart(cluster)
    return cluster


def _get(cluster: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _ensure_imported(cluster: Cluster, ref: str) -> None:
    """The node imported what images.txt listed when it started; a concurrent build-images.sh run without the
    runtime image (another checkout's `make test`) may have rewritten that list in between."""
    node = cluster.real_nodes[0]
    ctr = ["ctr", f"--address={node.socket}", "--namespace=k8s.io", "images"]
    listed = subprocess.run([*ctr, "ls", "-q"], capture_output=True, text=True, timeout=60).stdout.split()
    if not any(name.endswith(ref.split("/", 1)[1]) for name in listed):
        archive = images_dir() / "colocate-runtime.tar"
        print(f"importing {ref} (not in images.txt when the node started)", flush=True)
        subprocess.run([*ctr, "import", str(archive)], check=True, capture_output=True, timeout=600)


def _install_chart(cluster: Cluster) -> None:
    cluster.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": RESTRICTED}}]
    )
    t = time.monotonic()
    helm = [str(cluster.bin_dir / "helm"), f"--kubeconfig={cluster.kubeconfig}"]
    result = subprocess.run(
        [*helm, "install", RELEASE, str(ROOT / "charts" / "colocate-operator"), "-n", OPERATOR_NAMESPACE,
         "--create-namespace", *chart_values(NAMESPACE), "--wait", "--timeout", "180s"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if result.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, "-o", "wide", check=False).stdout
        raise SystemExit(f"demo: helm install failed:\n{result.stderr}\n{pods}")
    print(
        f"operator Deployment Ready in {time.monotonic() - t:.0f} s (helm install --wait: its probes green)"
    )
    print(cluster.kubectl("get", "deploy,pods", "-n", OPERATOR_NAMESPACE, "-o", "wide").stdout, end="")


BAD_WAITING = ("ErrImageNeverPull", "CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError")


def _wait_running(cluster: Cluster) -> str:
    """Wait until the job's Redis and worker pod's containers run; `kubectl get colocatejobs,pods` then."""
    deadline = time.monotonic() + PODS_TIMEOUT
    while time.monotonic() < deadline:
        pods = _get(cluster, "pods", "-n", NAMESPACE)["items"]
        _fail_on_bad_containers(pods)
        workers = [p for p in pods if "metastore" not in p["metadata"]["name"]]
        statuses = [s for p in pods for s in p.get("status", {}).get("containerStatuses", [])]
        if workers and len(statuses) >= 3 and all("running" in s.get("state", {}) for s in statuses):
            return cluster.kubectl("get", "colocatejobs,pods", "-n", NAMESPACE, "-o", "wide").stdout
        time.sleep(1)
    pods = cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
    raise SystemExit(f"demo: timed out after {PODS_TIMEOUT:.0f} s waiting for the job's containers:\n{pods}")


def _fail_on_bad_containers(pods: list[dict[str, Any]]) -> None:
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses", []):
            reason = status.get("state", {}).get("waiting", {}).get("reason")
            if reason in BAD_WAITING:
                raise SystemExit(
                    f"demo: container {status['name']} of pod {pod['metadata']['name']} is {reason}: "
                    f"{status['state']['waiting'].get('message', '')}"
                )


def _follow(cluster: Cluster, name: str, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Print `kubectl get colocatejobs` each time the job's status shows a new step, until the job ends;
    the pods as last seen before deletion, the trainer's log (read while its pod exists: the operator
    deletes it at the end) and the job's final status."""
    seen: dict[str, Any] = {"pods": {}, "trainer_log": "", "trainer_done": False, "pods_text": "(not seen)\n"}
    shown: Any = "none"
    printed = ""
    deadline = time.monotonic() + PODS_TIMEOUT + STEP_TIMEOUT * steps
    while time.monotonic() < deadline:
        status = _get(cluster, "colocatejob", name, "-n", NAMESPACE).get("status", {})
        step = (status.get("weightSync") or {}).get("lastCompletedStep")
        ended = status.get("phase") in ("Succeeded", "Failed")
        _observe(cluster, seen, read_log=step != shown)
        if step != shown or ended:
            headers = [] if shown == "none" else ["--no-headers"]
            table = cluster.kubectl("get", "colocatejobs", "-n", NAMESPACE, *headers).stdout
            if table.split()[:-1] != printed.split()[:-1]:  # the same row but for its AGE: shown already
                print(table, end="", flush=True)
                printed = table
            shown = step
        if ended:
            # The trainer's exit as the kubelet reported it (the operator may have begun deleting the pod).
            until = time.monotonic() + 20
            while not seen["trainer_done"] and time.monotonic() < until:
                time.sleep(0.5)
                if not _observe(cluster, seen, read_log=False):
                    break
            return seen, status
        time.sleep(0.3)
    pods_text = cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
    raise SystemExit(f"demo: the job did not end in time (last step seen: {shown}):\n{pods_text}")


def _observe(cluster: Cluster, seen: dict[str, Any], read_log: bool) -> int:
    """The job's pods into `seen` as last seen before the operator began deleting them, with the trainer's
    exit also from a pod being deleted; the trainer's log when asked and once more when it has exited.
    How many worker pods there are."""
    pods = _get(cluster, "pods", "-n", NAMESPACE)["items"]
    _fail_on_bad_containers(pods)
    statuses = [s for p in pods for s in p.get("status", {}).get("containerStatuses", [])]
    done = [s.get("ready") or "terminated" in s.get("state", {}) for s in statuses]  # Ready, or done
    if seen["pods_text"].startswith("(not") and len(done) >= 3 and all(done):
        seen["pods_text"] = cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
    for pod in pods:
        name = pod["metadata"]["name"]
        trainer = container_status(pod, "trainer")
        if not pod["metadata"].get("deletionTimestamp"):
            seen["pods"][name] = pod
        elif trainer and "terminated" in trainer["state"] and name in seen["pods"]:
            kept = seen["pods"][name]["status"]["containerStatuses"]
            kept[:] = [trainer if c["name"] == "trainer" else c for c in kept]
        if not trainer or seen["trainer_done"]:
            continue
        exited = "terminated" in trainer["state"]
        if read_log or exited:
            args = ("logs", pod["metadata"]["name"], "-c", "trainer", "-n", NAMESPACE)
            log = cluster.kubectl(*args, check=False).stdout
            if len(log) >= len(seen["trainer_log"]):
                seen["trainer_log"], seen["trainer_done"] = log, exited
    return sum(1 for pod in pods if container_status(pod, "trainer"))


def _containers_table(pods: list[dict[str, Any]]) -> None:
    print(f"{'pod':<52} {'node':<11} {'container':<10} {'image':<38} {'state':<16} restarts")
    for pod in pods:
        meta, spec = pod["metadata"], pod["spec"]
        for status in pod.get("status", {}).get("containerStatuses", []):
            state = next(iter(status.get("state", {})), "?")
            if state == "terminated":
                state = f"exited {status['state']['terminated'].get('exitCode')}"
            runtime = status.get("containerID", "").split("://")[0]
            print(
                f"{meta['namespace'] + '/' + meta['name']:<52} {spec.get('nodeName', '-'):<11} "
                f"{status['name']:<10} {status['image']:<38} {state + ' (' + runtime + ')':<16} "
                f"{status.get('restartCount', 0)}"
            )
