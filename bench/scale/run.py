"""One measured run: one operator, alone, against the testbed, with N jobs in a fresh namespace.

Timeline (all times time.time() on this machine):
  t0      the harness sends the first job's create request (operator already running and idle)
  created each job's create request has returned
  ...     wait until every GPU pod is Running and the operator reports every job up
  up      that moment: the "startup" window is [t0, up)
  t1      up plus a settle period: the "settle" window [up, t1) catches what the operator still does
  t2      t1 plus the steady period: the "steady" window [t1, t2), nothing changes in the cluster
Then the operator is stopped and the namespace deleted (pods force-deleted first).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.scale import audit
from bench.scale.kubeapi import ApiError
from bench.scale.operators import (
    OperatorProcess,
    Sampler,
    colocate_operator,
    kuberay_operator,
    peak_rss,
    usage,
)
from bench.scale.steps import Emitter
from bench.scale.testbed import OPERATOR_ACCOUNTS, Testbed, say, username
from bench.scale.tracker import PodTimes, Tracker
from bench.scale.workloads import GPUS_PER_POD, PODS_PER_JOB, WORKLOADS, Workload, job_name, stored_sizes

_ERROR_LINE = re.compile(r'"(?:level|severity|levelname)"\s*:\s*"(?:error|critical|fatal)"', re.IGNORECASE)


@dataclass(frozen=True)
class RunSpec:
    operator: str
    jobs: int
    settle_seconds: float = 30.0
    steady_seconds: float = 60.0
    step_seconds: float = 60.0  # colocate only: how long every job reports one step per second
    repeat: int = 0  # which of the interleaved repetitions of this size
    up_timeout: float | None = None  # bound on the wait for every pod Running; None: 180 s + 2 s per job
    profile_idle: bool = False  # py-spy samples our operator through the steady window (a dev tool)
    rate: float | None = None  # jobs created per second, evenly spaced; None: all at once (back to back)
    step_records: str = "job"  # how the step window's emitter writes (bench/scale/steps.py RECORDS)

    @property
    def timeout(self) -> float:
        """Bound on the wait for every pod Running: a run past it stops and is recorded as incomplete."""
        if self.up_timeout is not None:
            return self.up_timeout
        return 180.0 + 2.0 * self.jobs + (self.jobs / self.rate if self.rate else 0.0)

    @property
    def label(self) -> str:
        paced = f"-r{self.rate:g}".replace(".", "p") if self.rate else ""
        return f"{self.operator}-{self.jobs}{paced}-{self.repeat}"


CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _operator(
    bed: Testbed, spec: RunSpec, namespace: str, logs: Path, kuberay: Path | None
) -> OperatorProcess:
    log = logs / f"{spec.label}.log"
    if spec.operator in ("colocate", "colocate-managed"):
        with_steps = spec.operator == "colocate"
        return colocate_operator(
            namespace,
            bed.kubeconfigs["colocate"],
            log,
            with_steps=with_steps,
            pythonpath=bed.source.pythonpath,
        )
    assert kuberay is not None, "the KubeRay operator binary is needed"
    return kuberay_operator(kuberay, namespace, bed.kubeconfigs["kuberay"], log)


def _latencies(
    workload: Workload, created: dict[str, float], pods: list[PodTimes], ready: dict[str, float]
) -> dict[str, list[float]]:
    by_job: dict[str, list[PodTimes]] = {}
    for pod in pods:
        if pod.gpu:
            by_job.setdefault(pod.job, []).append(pod)
    out: dict[str, list[float]] = {"pods_created": [], "pods_running": [], "job_ready": []}
    for job, at in created.items():
        mine = by_job.get(job, [])
        if len(mine) >= PODS_PER_JOB:
            out["pods_created"].append(max(p.created for p in mine) - at)
            if all(p.running is not None for p in mine):
                out["pods_running"].append(max(p.running or 0.0 for p in mine) - at)
        if job in ready:
            out["job_ready"].append(ready[job] - at)
    return out


def _final_state(bed: Testbed, workload: Workload, namespace: str) -> dict[str, Any]:
    """Does every job's status agree with its pods once things are quiet? (No lost update.)"""
    items = bed.api.get(workload.path(namespace))["items"]
    wrong: list[str] = []
    for item in items:
        status = item.get("status") or {}
        if workload.kind == "colocate":
            ok = (
                status.get("phase") == "Running"
                and (status.get("replicas") or {}).get("running") == PODS_PER_JOB
                and status.get("ready") == f"{PODS_PER_JOB}/{PODS_PER_JOB}"
                and status.get("observedGeneration") == item["metadata"].get("generation")
            )
        else:
            ok = status.get("state") == "ready" and status.get("readyWorkerReplicas") == PODS_PER_JOB - 1
        if not ok:
            wrong.append(item["metadata"]["name"])
    pods = bed.api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
    gpu_pods = [p for p in pods if workload.is_gpu_pod(p)]
    return {
        "jobs": len(items),
        "jobs_with_stale_status": len(wrong),
        "stale_examples": wrong[:5],
        "gpu_pods": len(gpu_pods),
        "gpu_pods_not_running": sum(1 for p in gpu_pods if (p.get("status") or {}).get("phase") != "Running"),
        "other_pods": len(pods) - len(gpu_pods),
        "other_pods_running": sum(
            1
            for p in pods
            if not workload.is_gpu_pod(p) and (p.get("status") or {}).get("phase") == "Running"
        ),
    }


def _step_phase(
    bed: Testbed, spec: RunSpec, tracker: Tracker, namespace: str, jobs: list[str], pid: int
) -> dict[str, Any] | None:
    """colocate only: every job reports one step per second for spec.step_seconds; then wait (at
    most 120 s) until every job's status shows the last step. The audit window is counted afterwards.

    What the status showed, and when, comes from the tracker's watch of the jobs (it runs anyway), not from
    listing them: until 2026-12-07 a LIST of every job each second measured it, which at 1000 jobs was
    10-20 MB a second for the API server to read from etcd and encode while it served the status writes
    being measured."""
    if spec.operator != "colocate" or not spec.step_seconds or bed.redis is None:
        return None
    say(f"  step events: {len(jobs)} jobs x 1 step/s for {spec.step_seconds:.0f} s")
    cpu0, parts0, start = usage(pid).cpu_seconds, _parts_cpu(bed), time.time()
    emitter = Emitter(bed.redis, namespace, jobs, PODS_PER_JOB, GPUS_PER_POD, records=spec.step_records)
    emitter.start()
    time.sleep(spec.step_seconds)
    emitter.stop()
    # From when the last step's first record was written: until 2026-12-07 20:30 UTC from the emitter's
    # stop, up to a round (1 s) later, which flattered the catch-up by as much.
    emitted_at = emitter.last_round_at or time.time()
    behind, seen = len(jobs), tracker.steps_seen()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen = tracker.steps_seen()
        behind = sum(1 for job in jobs if seen.get(job, (None, 0.0))[0] != emitter.steps)
        if behind == 0:
            break
        time.sleep(0.2)
    lags = sorted(seen[job][1] - emitted_at for job in jobs if job in seen and not behind)
    end = emitted_at + lags[-1] if lags else time.time()
    rounds = sorted(emitter.round_seconds)
    say(
        f"  {emitter.steps} steps emitted; status caught up {end - emitted_at:.1f} s later "
        f"(p50 of the jobs {lags[len(lags) // 2] if lags else float('nan'):.1f} s), {behind} jobs behind"
    )
    return {
        "steps": emitter.steps,
        "records": spec.step_records,
        "emitter_late_rounds": emitter.late_rounds,
        "emitter_round_seconds_p50": rounds[len(rounds) // 2] if rounds else None,
        "catch_up_seconds": end - emitted_at,
        "catch_up_p50_seconds": lags[len(lags) // 2] if lags else None,
        "catch_up_method": "watch",
        "jobs_behind_after_catch_up": behind,
        "operator_cpu_seconds": usage(pid).cpu_seconds - cpu0,
        # until every job caught up (or the 120-s bound): which part of the machine the window kept busy
        "parts_cpu_seconds": {
            name: round(c - parts0.get(name, 0.0), 2) for name, c in _parts_cpu(bed).items()
        },
        "job_object_bytes": stored_sizes(bed.api.get(WORKLOADS["colocate"].path(namespace, jobs[0]))),
        "window": [start, end],
    }


def _parts_cpu(bed: Testbed) -> dict[str, float]:
    """CPU seconds so far of each control-plane process and of this harness (its creates and tracker)."""
    pids = {name: bed.pid_of(name) for name in CONTROL_PLANE}
    found = {name: usage(pid).cpu_seconds for name, pid in pids.items() if pid}
    own = psutil.Process().cpu_times()
    return found | {"harness": own.user + own.system}


def _profile(spec: RunSpec, operator: OperatorProcess) -> subprocess.Popen[bytes] | None:
    """py-spy (a dev tool, `pip install py-spy`) samples the operator through the steady window, without
    pausing it, into <logs>/<label>-idle.txt as collapsed stacks: where the idle CPU goes."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy) or not spec.steady_seconds:
        say("  --profile-idle: no py-spy found, not profiling")
        return None
    out = operator.log_path.parent / f"{spec.label}-idle.txt"
    argv = [spy, "record", "--pid", str(operator.pid), "--duration", str(int(spec.steady_seconds))]
    argv += ["--rate", "250", "--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid` so far, by native thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def _profiled(
    profiler: subprocess.Popen[bytes],
    operator: OperatorProcess,
    before: dict[int, float],
    after: dict[int, float],
) -> None:
    """Waits for py-spy, then writes each thread's CPU over the window, named by a `py-spy dump`, into
    <logs>/<label>-idle-threads.txt."""
    try:
        profiler.wait(30)
    except subprocess.TimeoutExpired:
        profiler.kill()
        profiler.wait(5)
    argv = [str(profiler.args[0]), "dump", "--pid", str(operator.pid), "--nonblocking"]
    dump = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    named = dict(re.findall(r"^Thread (\d+) \(\w+\): \"([^\"]*)\"", dump, re.MULTILINE))
    lines = [
        f"{cpu - before.get(tid, 0.0):8.2f} s  {tid} {named.get(str(tid), '?')}"
        for tid, cpu in sorted(after.items(), key=lambda kv: before.get(kv[0], 0.0) - kv[1])
    ]
    path = operator.log_path.parent / f"{operator.log_path.stem}-idle-threads.txt"
    path.write_text("\n".join(lines) + "\n\n" + dump)


def _busy(before: Any, after: Any) -> float:
    total = sum(after) - sum(before)
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    return (total - idle) / total if total > 0 else 0.0


def _log_errors(path: Path) -> dict[str, Any]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    bad = [line for line in lines if _ERROR_LINE.search(line) or line.startswith("Traceback")]
    return {"lines": len(lines), "error_lines": len(bad), "examples": [b[:400] for b in bad[:3]]}


@dataclass
class _Timeline:
    t0: float = 0.0
    created_all: float = 0.0
    done: float = 0.0
    t1: float = 0.0
    t2: float = 0.0
    complete: bool = False
    create_errors: int = 0


def _create_jobs(
    bed: Testbed, workload: Workload, namespace: str, jobs: int, tl: _Timeline, rate: float | None = None
) -> dict[str, float]:
    """Creates the jobs back to back, or `rate` a second (the i-th at t0 + i / rate: the way users create
    them, so the apiserver's queue is not full of the harness's creates while the operator works)."""
    created: dict[str, float] = {}
    metastore = bed.redis.addr if workload.operator == "colocate" and bed.redis else ""
    tl.t0 = time.time()
    for i in range(jobs):
        if rate:
            time.sleep(max(0.0, tl.t0 + i / rate - time.time()))
        name = job_name(i)
        try:
            bed.api.create(workload.path(namespace), workload.manifest(namespace, name, metastore))
        except ApiError as e:
            tl.create_errors += 1
            say(f"create {name} failed: {e}")
            continue
        created[name] = time.time()
    tl.created_all = time.time()
    return created


def _wait_up(spec: RunSpec, tracker: Tracker, operator: OperatorProcess, tl: _Timeline) -> None:
    """Until every GPU pod is Running and the operator reports every job up; bounded by spec.timeout."""
    want = spec.jobs * PODS_PER_JOB
    deadline = time.monotonic() + spec.timeout
    last_report = time.monotonic()
    while time.monotonic() < deadline:
        running, ready = tracker.gpu_pods_running(), tracker.jobs_ready()
        if running >= want and ready >= spec.jobs:
            tl.complete = True
            break
        if not operator.alive():
            say(f"{spec.operator} operator died: {operator.tail(1500)}")
            break
        if time.monotonic() - last_report > 15:
            say(
                f"  {running}/{want} GPU pods Running, {ready}/{spec.jobs} jobs up, "
                f"{time.time() - tl.t0:.0f} s"
            )
            last_report = time.monotonic()
        time.sleep(0.2)
    tl.done = time.time()


def run(bed: Testbed, spec: RunSpec, logs: Path, kuberay: Path | None = None) -> dict[str, Any]:
    """Measure one operator with spec.jobs jobs; the operator is stopped and the namespace deleted after,
    whatever happens."""
    workload = WORKLOADS[spec.operator]
    namespace = spec.label
    say(f"run {spec.operator} x {spec.jobs} jobs (repeat {spec.repeat}) in namespace {namespace}")
    bed.create_namespace(namespace)
    result: dict[str, Any] = {}
    try:
        bed.wait_listable(workload.path(namespace))
        if spec.operator == "colocate":
            bed.metastore_secret(namespace)
        operator = _operator(bed, spec, namespace, logs, kuberay)
        try:
            result = _measure(bed, spec, workload, namespace, operator)
            return result
        finally:
            operator.stop()
    finally:
        # A cleanup that runs past its bounds (an overloaded apiserver) must not lose the run measured: the
        # next run has a namespace of its own.
        try:
            deleted_in = bed.delete_namespace(namespace, workload.plural, workload.api_version)
            say(f"  namespace {namespace} deleted in {deleted_in:.1f} s")
        except Exception as e:  # recorded with the run, never raised past it
            say(f"  namespace {namespace} not deleted: {type(e).__name__}: {str(e)[:200]}")
            result["cleanup_error"] = f"{type(e).__name__}: {str(e)[:200]}"


def _measure(
    bed: Testbed, spec: RunSpec, workload: Workload, namespace: str, operator: OperatorProcess
) -> dict[str, Any]:
    log = audit.AuditLog(bed.audit_log)
    started = time.monotonic()
    operator.start()
    say(f"{spec.operator} operator ready in {time.monotonic() - started:.1f} s (pid {operator.pid})")
    sampler = Sampler(operator.pid).start()
    tracker = Tracker(bed.api, workload, namespace).start()
    apiserver = bed.pid_of("kube-apiserver") or 0
    tl = _Timeline()
    try:
        time.sleep(2)  # watches established, operator idle
        u0, a0, m0 = usage(operator.pid), usage(apiserver), psutil.cpu_times()
        parts0 = _parts_cpu(bed)
        created = _create_jobs(bed, workload, namespace, spec.jobs, tl, spec.rate)
        _wait_up(spec, tracker, operator, tl)
        ud, ad, md = usage(operator.pid), usage(apiserver), psutil.cpu_times()
        parts = {name: cpu - parts0.get(name, 0.0) for name, cpu in _parts_cpu(bed).items()}
        load = os.getloadavg()[0]
        pods, ready_at = tracker.snapshot()
        time.sleep(spec.settle_seconds)
        tl.t1, u1, a1 = time.time(), usage(operator.pid), usage(apiserver)
        profiler = _profile(spec, operator) if spec.profile_idle else None
        threads0 = thread_cpu(operator.pid)
        time.sleep(spec.steady_seconds)
        tl.t2, u2, a2 = time.time(), usage(operator.pid), usage(apiserver)
        if profiler is not None:  # each thread's CPU over the steady window exactly (py-spy may end later)
            _profiled(profiler, operator, threads0, thread_cpu(operator.pid))
        final = _final_state(bed, workload, namespace)
        stepped = _step_phase(bed, spec, tracker, namespace, list(created), operator.pid)
        hwm = peak_rss(operator.pid)
        sampler.sample()
    finally:
        sampler.stop()
        tracker.stop()
    operator.stop()
    time.sleep(1)
    log.refresh()
    user = username(workload.kind)
    startup = audit.count(log.window(user, tl.t0, tl.done), workload.plural)
    operators = {username(name) for name in OPERATOR_ACCOUNTS}
    caused = audit.count(log.in_namespace(namespace, tl.t0, tl.done, operators), workload.plural)
    settle = audit.count(log.window(user, tl.done, tl.t1), workload.plural)
    steady = audit.count(log.window(user, tl.t1, tl.t2), workload.plural)

    want = spec.jobs * PODS_PER_JOB
    gpu_running = [p.running for p in pods if p.gpu and p.running is not None]
    t_all_running = max(gpu_running) if len(gpu_running) >= want else None
    t_all_ready = max(ready_at.values()) if len(ready_at) >= spec.jobs else None
    if tl.complete:
        say(
            f"  all {want} GPU pods Running after {(t_all_running or tl.done) - tl.t0:.1f} s, "
            f"all jobs up after {(t_all_ready or tl.done) - tl.t0:.1f} s"
        )
    cpu = {"operator": ud.cpu_seconds - u0.cpu_seconds, **parts}
    say("  CPU s until up: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items()))
    if not tl.complete:
        say(
            f"  NOT COMPLETE after {tl.done - tl.t0:.0f} s: {len(gpu_running)}/{want} GPU pods Running, "
            f"{len(ready_at)}/{spec.jobs} jobs up"
        )
    if stepped:
        counts = audit.count(log.window(user, stepped["window"][0], stepped["window"][1]), workload.plural)
        steps_total = max(1, stepped["steps"] * len(created))
        stepped.update(
            requests=counts.as_dict(),
            status_writes_per_job_per_step=counts.status_writes / steps_total,
            requests_per_job_per_step=counts.total / steps_total,
        )
    latencies = _latencies(workload, created, pods, ready_at)
    raw = {
        "created": created,
        "ready": ready_at,
        "pods": [asdict(p) for p in pods],
        "t0": tl.t0,
        # (time, operator CPU s, operator RSS bytes) every 0.5 s, through the step window
        "operator_usage": sampler.samples,
    }
    (operator.log_path.parent / f"{spec.label}-timeline.json").write_text(json.dumps(raw))
    jobs = max(1, spec.jobs)
    per_minute = 60.0 / spec.steady_seconds / jobs if spec.steady_seconds else 0.0
    result = {
        "operator": spec.operator,
        "jobs": spec.jobs,
        "repeat": spec.repeat,
        "spec": asdict(spec),
        "complete": tl.complete,
        "create_errors": tl.create_errors,
        "create_seconds": tl.created_all - tl.t0,
        "all_pods_running_seconds": (t_all_running - tl.t0) if t_all_running else None,
        "all_jobs_ready_seconds": (t_all_ready - tl.t0) if t_all_ready else None,
        "latency": {
            kind: {
                "p50": percentile(values, 50),
                "p99": percentile(values, 99),
                "max": max(values) if values else None,
                "n": len(values),
            }
            for kind, values in latencies.items()
        },
        "requests": {
            "startup": startup.as_dict(),
            "settle": settle.as_dict(),
            "steady": steady.as_dict(),
            "startup_per_job": startup.total / jobs,
            "steady_per_job_per_minute": steady.total * per_minute,
            "status_writes_startup_per_job": startup.status_writes / jobs,
            "status_writes_settle_per_job": settle.status_writes / jobs,
            "status_writes_steady_per_job_per_minute": steady.status_writes * per_minute,
            "job_writes_startup_per_job": startup.job_writes / jobs,
            # The controller-manager's writes that the operator's objects caused until up (PDB status,
            # EndpointSlices): not the operator's requests, but the same apiserver's work.
            "controller_writes_startup": caused.as_dict(),
            "controller_writes_startup_per_job": caused.writes / jobs,
        },
        "operator_cpu_seconds": {
            "startup": ud.cpu_seconds - u0.cpu_seconds,
            "settle": u1.cpu_seconds - ud.cpu_seconds,
            "steady": u2.cpu_seconds - u1.cpu_seconds,
        },
        "apiserver_cpu_seconds": {
            "startup": ad.cpu_seconds - a0.cpu_seconds,
            "settle": a1.cpu_seconds - ad.cpu_seconds,
            "steady": a2.cpu_seconds - a1.cpu_seconds,
        },
        # Until up, by process: the machine is saturated then, so whatever a run makes any part of the
        # control plane (or the harness creating and tracking the jobs) do delays all of them.
        "cpu_seconds_until_up": cpu,
        # The machine is shared: how busy it was while the jobs started (all cores, 1.0 = all busy).
        "machine": {"busy_fraction_startup": _busy(m0, md), "loadavg_1m_after_startup": load},
        "operator_rss_bytes": {
            "idle": u0.rss_bytes,
            "end": u2.rss_bytes,
            "peak_sampled": sampler.peak_rss_bytes,
            "peak_vmhwm": hwm,
            # Sampled every 0.5 s until the step window (or the idle window's end): what the jobs' start
            # costs, apart from what following their step streams costs.
            "peak_sampled_before_steps": max(
                (rss for at, _, rss in sampler.samples if at < (stepped["window"][0] if stepped else tl.t2)),
                default=0,
            ),
        },
        "final_state": final,
        "operator_log": _log_errors(operator.log_path),
        "tracker_errors": tracker.errors,
        "status_changes_seen_per_job": sum(tracker.job_status_changes.values()) / jobs,
        "step_events": stepped or "not measured in this run",
        "windows": {"t0": tl.t0, "up": tl.done, "t1": tl.t1, "t2": tl.t2},
    }
    say(
        f"  requests/job {result['requests']['startup_per_job']:.1f}, "
        f"status writes/job {result['requests']['status_writes_startup_per_job']:.1f}, "
        f"operator CPU {result['operator_cpu_seconds']['startup']:.1f} s, "
        f"peak RSS {max(hwm, sampler.peak_rss_bytes) / 2**20:.0f} MiB"
    )
    return result
