"""`make demo`: the whole product on this machine, end to end.

A real control plane with fake GPU nodes; the Helm chart; the operator; `examples/colocatejob.yaml`; then, for
each of the job's pods, the two processes its containers would run (no kubelet here: kwok only marks pods
Running), started with the environment the operator put into the pod: a trainer doing real training steps on a
tiny LM, and the SGLang STAND-IN holding the same model. Weights move through the real Redis meta-store on the
shared-memory path (the CPU stand-in for CUDA IPC); every step shows up in `kubectl get colocatejobs`.

`--real-node` runs it on real containers instead (demo/realnode_demo.py): images built here, a real kubelet,
the operator as the chart's Deployment, the job's Redis, trainer and SGLang stand-in as containers.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from colocate_devcluster import Cluster, ClusterSpec
from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import megatron_example as megatron  # noqa: E402
import realnode_demo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOADER = "colocate_runtime.sglang.loader.load_colocated_step"
INIT_LOADER = "colocate_runtime.sglang.loader.start_colocated"
STEP_TIMEOUT = 120.0


def say(message: str) -> None:
    print(f"\n\033[1m== {message}\033[0m", flush=True)


def wait(probe: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"demo: timed out after {timeout:.0f} s waiting for {what}")


def spawn(
    stack: ExitStack, argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    handle = open(log, "ab")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(
        argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT
    )
    handle.close()

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    stack.callback(stop)
    return proc


def container_env(cluster: Cluster, pod: dict, container: str) -> dict[str, str]:
    """The container's environment as a kubelet would resolve it (values, Secret keys, pod fields)."""
    spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
            secret = json.loads(
                cluster.kubectl(
                    "get", "secret", ref["name"], "-n", pod["metadata"]["namespace"], "-o", "json"
                ).stdout
            )
            if ref["key"] in secret.get("data", {}):
                env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            elif not ref.get("optional"):  # a kubelet would not start the container
                raise KeyError(f"Secret {ref['name']} has no key {ref['key']}")
        elif ref := var.get("valueFrom", {}).get("fieldRef"):
            value: Any = pod
            for part in ref["fieldPath"].split("."):
                value = value.get(part, "") if isinstance(value, dict) else ""
            env[var["name"]] = str(value)
    return env


def job_status(cluster: Cluster, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "colocatejob", name, "-n", "demo", "-o", "json").stdout).get(
        "status", {}
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="weight-update steps to run (default 5)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".devcluster-demo")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    parser.add_argument(
        "--example",
        choices=("tiny", "megatron"),
        default="tiny",
        help="tiny: a tiny LM and the SGLang stand-in (quick); megatron: examples/megatron (megatron-core at "
        "TP 2 under torchrun, real SGLang at TP 2, a few minutes)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(megatron.MODELS),
        default="qwen3",
        help="with --example megatron: the tiny model (qwen3-moe: four experts)",
    )
    parser.add_argument(
        "--train-expert",
        type=int,
        help="with --example megatron: the trainer's expert parallel size (parallelism.train.expert)",
    )
    parser.add_argument(
        "--train-tensor",
        type=int,
        help="with --example megatron: the trainer's tensor parallel size (parallelism.train.tensor); 1: "
        "two data-parallel trainer ranks feeding SGLang at TP 2",
    )
    parser.add_argument(
        "--real-node",
        action="store_true",
        help="real containers: build the images here, run the chart's operator Deployment and the job's "
        "Redis, trainer and SGLang stand-in on a real kubelet (needs root; minutes: README, the real node)",
    )
    args = parser.parse_args()
    if args.real_node:
        if args.example != "tiny":
            parser.error("--real-node runs the tiny example only")
        return realnode_demo.main(args, step_table=_summary)
    # Ctrl-C or a kill still tears everything down (the ExitStack below runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    shutil.rmtree(args.workdir, ignore_errors=True)
    logs = args.workdir / "logs"
    with ExitStack() as stack:
        say("1/7 a local control plane (etcd, apiserver, controller-manager, scheduler; kwok fake GPU nodes)")
        cluster = Cluster(ClusterSpec(workdir=args.workdir, gpu_nodes=4, gpus_per_node=8)).start()
        if not args.keep:
            stack.callback(cluster.stop)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        print(cluster.kubectl("get", "nodes").stdout, end="")

        say("2/7 helm install colocate-operator (CRD, RBAC, Deployment; kwok 'runs' its pod, no container)")
        subprocess.run(
            [
                str(cluster.bin_dir / "helm"),
                "install",
                "colocate-operator",
                str(ROOT / "charts" / "colocate-operator"),
                "-n",
                "colocate-system",
                "--create-namespace",
                "--wait",
                "--timeout",
                "120s",
                # The demo's meta-store is a redis-server on this machine: the one External address allowed.
                "--set-json",
                'externalMetaStore.allowedAddresses=["127.0.0.1"]',
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        print(cluster.kubectl("get", "deploy,crd", "-n", "colocate-system").stdout, end="")

        say("3/7 the operator, running here against the cluster (no kubelet runs the container above)")
        metrics_port = free_port()
        operator = spawn(
            stack,
            [
                PY,
                "-m",
                "colocate_operator",
                "--log-format=plain",
                "--liveness=",
                f"--metrics-port={metrics_port}",
            ],
            logs / "operator.log",
            {**env, "COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1"},  # as the chart above passes it
        )
        print(
            f"operator pid {operator.pid}, log {logs / 'operator.log'}, metrics http://127.0.0.1:{metrics_port}/metrics"
        )

        say("4/7 the job's meta-store: a real redis-server with a password kept in a Secret")
        redis = RedisServer(logs).start()
        stack.callback(redis.stop)
        password = redis.password
        cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}}])
        cluster.kubectl(
            "create",
            "secret",
            "generic",
            "demo-metastore",
            "-n",
            "demo",
            f"--from-literal=password={password}",
        )

        job_file = megatron.JOB if args.example == "megatron" else ROOT / "examples" / "colocatejob.yaml"
        say(f"5/7 kubectl apply -f {job_file.relative_to(ROOT)}")
        job = yaml.safe_load(job_file.read_text())
        job["spec"]["metaStore"]["external"]["address"] = redis.addr
        if args.example == "megatron":
            megatron.prepare(
                job,
                args.workdir,
                args.steps,
                train_tensor=args.train_tensor,
                train_expert=args.train_expert,
                model=args.model,
            )
        cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
        pods = wait(lambda: _running_pods(cluster, job["spec"]["numNodes"]), 120, "the job's pods Running")
        print(cluster.kubectl("get", "colocatejobs,pods", "-n", "demo", "-o", "wide").stdout, end="")

        start = _start_megatron if args.example == "megatron" else _start_tiny
        trainers = start(stack, cluster, job, pods, logs, args.steps)
        name = job["metadata"]["name"]
        _follow_steps(cluster, name, trainers, args.steps)
        # No kubelet: report the containers' exit as one would, so the operator can see the pods finish.
        for pod in pods:
            cluster.kubectl(
                "patch",
                "pod",
                pod["metadata"]["name"],
                "-n",
                "demo",
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": {"phase": "Succeeded"}}),
            )
        status = wait(
            lambda: (s := job_status(cluster, name)).get("phase") in ("Succeeded", "Failed") and s,
            60,
            "the job to finish (the trainers' final records)",
        )
        print(cluster.kubectl("get", "colocatejobs", "-n", "demo").stdout, end="")

        say("7/7 summary")
        results = {i: _trainer_lines(logs / f"trainer-{i}.log") for i, _ in trainers}
        if args.example == "megatron":  # SGLang's parameters against the trainer's, bit for bit
            bitwise = megatron.bitwise_steps(args.workdir / "check")
            for lines in results.values():
                for record in lines:
                    record["bitwise"] = bitwise.get(record.get("step", -1), False)
        _summary(status, results)
        ok = status.get("phase") == "Succeeded" and all(
            matches(r) for lines in results.values() for r in lines if "step" in r
        )
        print(
            f"\ndemo {'succeeded' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s; logs in {logs}"
        )
        if args.keep:
            print(
                f"cluster left running: export KUBECONFIG={cluster.kubeconfig}; stop with `make cluster-down "
                f"COLOCATE_DEVCLUSTER_DIR={args.workdir}`"
            )
        return 0 if ok else 1


def _start_tiny(
    stack: ExitStack, cluster: Cluster, job: dict, pods: list[dict], logs: Path, steps: int
) -> list[tuple[str, subprocess.Popen]]:
    say(f"6/7 per pod: a trainer and the SGLang stand-in, {steps} weight-update steps")
    trainers = []
    for pod in pods:
        index = _index(pod)
        rollout_port = free_port()
        overrides = {
            "COLOCATE_TRANSPORT": "SharedMemory",  # CPU stand-in for CUDA IPC
            "COLOCATE_SGLANG_URL": f"http://127.0.0.1:{rollout_port}",
            "OMP_NUM_THREADS": "1",
            "DEMO_STEPS": str(steps),
        }
        base = {k: v for k, v in os.environ.items() if not k.startswith("COLOCATE_")}
        rollout_env = {**base, **container_env(cluster, pod, "rollout"), **overrides}
        trainer_env = {**base, **container_env(cluster, pod, "trainer"), **overrides}
        argv = [PY, "-m", "colocate_runtime.sglang.standin", "--port", str(rollout_port)]
        spawn(
            stack,
            [*argv, "--custom-weight-loader", LOADER, INIT_LOADER],
            logs / f"rollout-{index}.log",
            rollout_env,
        )
        trainer = spawn(
            stack, [PY, str(ROOT / "demo" / "trainer.py")], logs / f"trainer-{index}.log", trainer_env
        )
        trainers.append((index, trainer))
    return trainers


def _start_megatron(
    stack: ExitStack, cluster: Cluster, job: dict, pods: list[dict], logs: Path, steps: int
) -> list[tuple[str, subprocess.Popen]]:
    workdir = logs.parent
    say(f"6/7 per pod: the containers' own commands (torchrun + megatron-core, real SGLang), {steps} steps")
    trainers = []
    for pod in pods:
        index = _index(pod)
        rollout_port = free_port()
        overrides = {
            "COLOCATE_TRANSPORT": "SharedMemory",  # CPU stand-in for CUDA IPC
            "COLOCATE_ROLLOUT_PORT": str(rollout_port),
            "COLOCATE_SGLANG_URL": f"http://127.0.0.1:{rollout_port}",
            "COLOCATE_RENDEZVOUS_ADDR": f"127.0.0.1:{free_port()}",  # no cluster DNS here
        }
        base = {k: v for k, v in os.environ.items() if not k.startswith("COLOCATE_")}
        rollout_env = megatron.rollout_env({**base, **container_env(cluster, pod, "rollout"), **overrides})
        rollout_env = megatron.with_dump(rollout_env, workdir)
        trainer_env = megatron.trainer_env({**base, **container_env(cluster, pod, "trainer"), **overrides})
        spawn(stack, megatron.rollout_argv(job, rollout_env), logs / f"rollout-{index}.log", rollout_env)
        trainer = spawn(
            stack, megatron.trainer_argv(job, trainer_env), logs / f"trainer-{index}.log", trainer_env
        )
        print(f"pod {index}: SGLang on 127.0.0.1:{rollout_port}; logs {logs}/{{rollout,trainer}}-{index}.log")
        trainers.append((index, trainer))
    return trainers


def _index(pod: dict) -> str:
    return pod["metadata"]["labels"].get("colocate.dev/replica-index") or pod["metadata"]["name"][-1]


def _running_pods(cluster: Cluster, count: int) -> list[dict] | None:
    items = json.loads(cluster.kubectl("get", "pods", "-n", "demo", "-o", "json").stdout)["items"]
    running = [
        p
        for p in items
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    return sorted(running, key=lambda p: p["metadata"]["name"]) if len(running) == count else None


def _follow_steps(
    cluster: Cluster, name: str, trainers: list[tuple[str, subprocess.Popen]], steps: int
) -> None:
    """Print `kubectl get colocatejobs` each time the job's status shows a new step."""
    shown = None
    deadline = time.monotonic() + STEP_TIMEOUT * steps
    while time.monotonic() < deadline:
        step = job_status(cluster, name).get("weightSync", {}).get("lastCompletedStep")
        if step != shown:
            shown = step
            args = ["get", "colocatejobs", "-n", "demo"] + (["--no-headers"] if step else [])
            print(cluster.kubectl(*args).stdout, end="", flush=True)
        if shown == steps:
            return
        if any(p.poll() not in (None, 0) for _, p in trainers):
            raise SystemExit("demo: a trainer failed; see its log (logs/trainer-N.log in the work directory)")
        if all(p.poll() is not None for _, p in trainers):
            deadline = min(deadline, time.monotonic() + 30)  # trainers done: status must follow soon
        time.sleep(0.3)
    raise SystemExit(
        f"demo: the job's status did not reach step {steps} (last seen: {shown}); see the operator log"
    )


def _trainer_lines(log: Path) -> list[dict]:
    lines = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def matches(record: dict) -> bool:
    """The rollout engine holds the trainer's weights: the tiny trainer's bitwise check, or the megatron
    example's parameters bit for bit and its greedy output equal to transformers' from the trainer's."""
    if "rollout_matches_trainer" in record:
        return bool(record["rollout_matches_trainer"])
    return bool(record.get("greedy_equal") and record.get("bitwise"))


def _summary(status: dict, results: dict[str, list[dict]]) -> None:
    recent = {r["step"]: r for r in status.get("recentSteps", [])}
    first = next(iter(results.values()), [])
    print(
        f"{'step':>4}  {'reward':>6}  {'loss':>7}  {'result':>9}  {'sync s (status)':>15}  {'bytes':>7}"
        "  rollout == trainer"
    )
    for record in first:
        step = record.get("step")
        if step is None:
            continue
        s = recent.get(step, {})
        same = all(any(r.get("step") == step and matches(r) for r in lines) for lines in results.values())
        print(
            f"{step:>4}  {record['reward']:>6.3f}  {record['loss']:>7.4f}  {s.get('result', '-'):>9}  "
            f"{s.get('syncSeconds', 0):>15.4f}  {s.get('bytes', 0):>7}  {'yes, every pod' if same else 'NO'}"
        )
    print(
        f"phase {status.get('phase')}; conditions: "
        + ", ".join(f"{c['type']}={c['status']}" for c in status.get("conditions", []))
    )


if __name__ == "__main__":
    sys.exit(main())
