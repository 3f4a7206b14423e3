"""Watches a run's namespace and timestamps, on arrival, what happens to each job and its pods.

Times are time.time() on this machine, the clock the audit log also uses. For each pod: when it was first
seen (created), first seen bound to a node, first seen in phase Running. For each job: when the operator
first reported it up (see Workload.job_ready), and when its status first showed each completed step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from bench.scale.kubeapi import Api
from bench.scale.workloads import Workload


@dataclass
class PodTimes:
    job: str
    gpu: bool
    created: float
    scheduled: float | None = None
    running: float | None = None


@dataclass
class Tracker:
    api: Api
    workload: Workload
    namespace: str
    pods: dict[str, PodTimes] = field(default_factory=dict)
    job_ready: dict[str, float] = field(default_factory=dict)
    job_status_changes: dict[str, int] = field(default_factory=dict)
    job_step: dict[str, tuple[int, float]] = field(default_factory=dict)  # lastCompletedStep, when first seen
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _last_status: dict[str, Any] = field(default_factory=dict)

    def start(self) -> Tracker:
        targets = [
            (f"/api/v1/namespaces/{self.namespace}/pods", self._on_pod),
            (self.workload.path(self.namespace), self._on_job),
        ]
        for path, handler in targets:
            thread = threading.Thread(target=self._follow, args=(path, handler), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _follow(self, path: str, handler: Any) -> None:
        try:
            for arrived, event in self.api.watch(path, self._stop):
                with self._lock:
                    handler(arrived, event)
        except Exception as e:  # reported with the results; the run then times out waiting
            self.errors.append(f"watch {path}: {e!r}")

    def _on_pod(self, now: float, event: dict[str, Any]) -> None:
        if event["type"] == "DELETED":
            return
        pod = event["object"]
        labels = pod["metadata"].get("labels") or {}
        job = labels.get(self.workload.pod_job_label)
        if job is None:
            return
        times = self.pods.get(pod["metadata"]["uid"])
        if times is None:
            times = self.pods[pod["metadata"]["uid"]] = PodTimes(job, self.workload.is_gpu_pod(pod), now)
        if times.scheduled is None and pod["spec"].get("nodeName"):
            times.scheduled = now
        if times.running is None and (pod.get("status") or {}).get("phase") == "Running":
            times.running = now

    def _on_job(self, now: float, event: dict[str, Any]) -> None:
        body = event["object"]
        name = body["metadata"]["name"]
        status = body.get("status")
        if event["type"] != "DELETED" and status != self._last_status.get(name):
            if name in self._last_status:
                self.job_status_changes[name] = self.job_status_changes.get(name, 0) + 1
            self._last_status[name] = status
        if name not in self.job_ready and self.workload.job_ready(body):
            self.job_ready[name] = now
        step = ((status or {}).get("weightSync") or {}).get("lastCompletedStep")
        if step is not None and self.job_step.get(name, (None, 0.0))[0] != step:
            self.job_step[name] = (step, now)

    # -- queries (under the lock) ----------------------------------------------------------------------------
    def gpu_pods_running(self) -> int:
        with self._lock:
            return sum(1 for p in self.pods.values() if p.gpu and p.running is not None)

    def jobs_ready(self) -> int:
        with self._lock:
            return len(self.job_ready)

    def steps_seen(self) -> dict[str, tuple[int, float]]:
        """Each job's newest `status.weightSync.lastCompletedStep` and when the watch first brought it."""
        with self._lock:
            return dict(self.job_step)

    def snapshot(self) -> tuple[list[PodTimes], dict[str, float]]:
        with self._lock:
            return list(self.pods.values()), dict(self.job_ready)
