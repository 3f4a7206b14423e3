"""Restart control-plane components that exit on their own, as a kubelet restarts a static pod.

In a real cluster kube-scheduler, kube-controller-manager and the apiserver run as static pods with
`restartPolicy: Always`, and they rely on it: kube-scheduler exits on purpose when it finds its cache
corrupted (after an apiserver restart, a pod it holds on one node is reported on another), expecting to be
started again with a fresh cache. Without a restart the local cluster stops scheduling for good, which a
real one never does (the fault soak's seed 1 found exactly that). A component stopped on purpose
(`Cluster.stop_component`) is left alone.

Backoff as the kubelet's CrashLoopBackOff: the first restart at once, then 10 s doubling to 5 min, reset once
a component has run 10 min.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from colocate_devcluster.processes import Component

FIRST_BACKOFF = 10.0
MAX_BACKOFF = 300.0
RESET_AFTER = 600.0
POLL = 0.5


def next_delay(restarts_in_a_row: int) -> float:
    """Seconds before the next restart after `restarts_in_a_row` restarts without a long enough run."""
    if restarts_in_a_row == 0:
        return 0.0
    return min(FIRST_BACKOFF * 2 ** (restarts_in_a_row - 1), MAX_BACKOFF)


@dataclass
class _Watch:
    component: Component
    in_a_row: int = 0
    started_at: float = field(default_factory=time.monotonic)
    due: float | None = None  # when a restart of the exited component is due


class Supervisor:
    """A daemon thread restarting the given components when they exit unless they were stopped on purpose.
    `lock` is held around each restart; the cluster holds it too while it stops or starts a component."""

    def __init__(
        self,
        components: Sequence[Component],
        lock: threading.Lock,
        say: Callable[[str], None],
        on_restart: Callable[[Component], None] = lambda _: None,
    ) -> None:
        self._watches = [_Watch(c) for c in components]
        self._lock = lock
        self._say = say
        self._on_restart = on_restart
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devcluster-supervisor", daemon=True)
        self.restarts: dict[str, int] = {c.name: 0 for c in components}

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            with self._lock:
                for watch in self._watches:
                    self._check(watch, time.monotonic())

    def _check(self, watch: _Watch, now: float) -> None:
        component = watch.component
        if not component.wanted or component.alive():
            watch.due = None
            if component.alive() and now - watch.started_at >= RESET_AFTER:
                watch.in_a_row = 0
            return
        if watch.due is None:
            watch.due = now + next_delay(watch.in_a_row)
            code = component.process.returncode if component.process is not None else "?"
            self._say(
                f"{component.name} exited with code {code}; restarting it in {watch.due - now:.0f} s "
                f"(as a kubelet restarts a static pod; log: {component.log_path})"
            )
        if now < watch.due:
            return
        component.start()
        watch.in_a_row += 1
        watch.started_at, watch.due = now, None
        self.restarts[component.name] += 1
        self._on_restart(component)
