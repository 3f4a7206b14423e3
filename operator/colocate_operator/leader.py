"""Leader election between operator replicas on a coordination.k8s.io Lease (issue 30, item 10).

client-go's leaderelection, reduced to what this operator needs: a candidate takes the Lease when it is
free, released, or not renewed for `leaseDurationSeconds` as the candidate's own clock saw it (never the
holder's renewTime: the clocks of two nodes may differ); the leader renews it every `retry_period` and stops
leading when it could not renew for `renew_deadline` (shorter than the lease, so it stops before anyone else
may take over) or when it finds the Lease held by another. Every write is a PUT carrying the resourceVersion
it was read at, so two candidates never both win: the API server refuses the second with a 409.

`decide_lease` is the pure decision; `LeaderElector` runs it on a thread. Losing the lease ends the process
(`on_stopped_leading`; as client-go's callers do): a half-stopped leader could still write.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from colocate_operator import kube

log = logging.getLogger("colocate_operator.leader")

LEASE_DURATION_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0
RETRY_PERIOD_SECONDS = 2.0

CREATE, RENEW, TAKE, WAIT = "create", "renew", "take", "wait"


@dataclass(frozen=True)
class Settings:
    namespace: str
    name: str = "colocate-operator"
    identity: str = ""
    lease_duration: float = LEASE_DURATION_SECONDS
    renew_deadline: float = RENEW_DEADLINE_SECONDS
    retry_period: float = RETRY_PERIOD_SECONDS

    def __post_init__(self) -> None:
        if not self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")


def default_identity() -> str:
    """The pod's name (the hostname in a pod) and a random suffix: a restarted container is a new holder."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Observation:
    """The Lease's holder record as this candidate saw it: `since` dates its last change (this candidate's
    monotonic clock), `read_at` is the newest read that still saw it."""

    holder: str
    duration: float
    version: str  # holder, renewTime and transitions: every renewal changes it
    since: float
    read_at: float


def holder_record(lease: dict[str, Any] | None) -> tuple[str, float, str]:
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    duration = float(spec.get("leaseDurationSeconds") or LEASE_DURATION_SECONDS)
    version = f"{holder}|{spec.get('renewTime')}|{spec.get('leaseTransitions')}"
    return holder, duration, version


def observe(lease: dict[str, Any] | None, previous: Observation | None, read_at: float) -> Observation:
    """The observation after a read issued at `read_at`. An unchanged record keeps its date. A changed one
    is dated at the previous read (the change came after it, so that is the earliest it can have been; the
    first read dates it now): up to one retry period early, which shortens a takeover by as much and stays
    safe, since a leader stops at its renew deadline, 5 s before its lease would run out."""
    holder, duration, version = holder_record(lease)
    if previous is not None and previous.version == version:
        return Observation(holder, duration, version, previous.since, read_at)
    since = previous.read_at if previous is not None else read_at
    return Observation(holder, duration, version, since, read_at)


def decide_lease(
    lease: dict[str, Any] | None, seen: Observation | None, identity: str, now: float
) -> tuple[str, float]:
    """What to do with the Lease as just read (`seen`: `observe` of this very read), and, for WAIT, the
    seconds until it may be taken."""
    if lease is None:
        return CREATE, 0.0
    holder, duration, _ = holder_record(lease)
    if holder == identity:
        return RENEW, 0.0
    if not holder:
        return TAKE, 0.0  # released by a leader that stopped cleanly
    assert seen is not None
    expires = seen.since + duration
    if now >= expires:
        return TAKE, 0.0
    return WAIT, expires - now


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    settings: Settings, identity: str, lease: dict[str, Any] | None, *, take: bool
) -> dict[str, Any]:
    """The Lease as this candidate writes it: created, taken over (transitions + 1) or renewed."""
    now = _now_micro()
    spec = dict((lease or {}).get("spec") or {})
    if lease is None or take:
        spec["acquireTime"] = now
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease is not None else 0)
    spec.update(holderIdentity=identity, leaseDurationSeconds=int(settings.lease_duration), renewTime=now)
    metadata: dict[str, Any] = {"name": settings.name, "namespace": settings.namespace}
    if lease is not None:
        metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}


class LeaderElector:
    """Campaigns for the Lease on its own thread; calls `on_started_leading` once it holds it, keeps it
    renewed, and calls `on_stopped_leading` when it lost it (then returns)."""

    def __init__(
        self,
        api: kube.Kube,
        settings: Settings,
        on_started_leading: Callable[[], None],
        on_stopped_leading: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.settings = settings
        self.identity = settings.identity or default_identity()
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.clock = clock
        self.leading = threading.Event()
        self._seen: Observation | None = None
        self._renewed = 0.0
        self._lock = threading.Lock()

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="leader-election", daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event) -> None:
        what = {"lease": f"{self.settings.namespace}/{self.settings.name}", "identity": self.identity}
        log.info("campaigning for leadership", extra=what)
        while not stop.is_set():
            held, wait = self.try_acquire_or_renew()
            if held:
                break
            stop.wait(min(wait, self.settings.retry_period) if wait > 0 else self.settings.retry_period)
        else:
            return
        self._renewed = self.clock()
        self.leading.set()
        log.info("leading", extra=what)
        threading.Thread(target=self._watchdog, args=(stop,), name="leader-watchdog", daemon=True).start()
        self.on_started_leading()
        while not stop.wait(self.settings.retry_period) and self.leading.is_set():
            held, _ = self.try_acquire_or_renew()
            if held:
                self._renewed = self.clock()
            elif self._seen is not None and self._seen.holder not in ("", self.identity):
                self._stop_leading(f"the lease is held by {self._seen.holder}")
        if stop.is_set():
            self.release()

    def _watchdog(self, stop: threading.Event) -> None:
        """Stops leading at the renew deadline even while a renewal hangs in the API server's client."""
        while self.leading.is_set() and not stop.wait(0.5):
            late = self.clock() - self._renewed
            if late >= self.settings.renew_deadline:
                self._stop_leading(f"the lease was not renewed for {late:.1f} s")

    def _stop_leading(self, why: str) -> None:
        with self._lock:
            if not self.leading.is_set():
                return
            self.leading.clear()
        log.error("stopped leading: %s", why, extra={"identity": self.identity})
        self.on_stopped_leading()

    def try_acquire_or_renew(self) -> tuple[bool, float]:
        """One round: read the Lease, decide, write. (held now, seconds until it may be taken)."""
        s = self.settings
        before = self.clock()
        try:
            lease = self.api.get(kube.LEASES, s.namespace, s.name)
        except Exception as e:  # a refused connection is urllib3's own error, not an OSError
            log.warning("reading the lease failed: %s", e)
            return False, s.retry_period
        self._seen = observe(lease, self._seen, before)
        action, wait = decide_lease(lease, self._seen, self.identity, self.clock())
        if action == WAIT:
            return False, wait
        try:
            if action == CREATE:
                self.api.create(kube.LEASES, s.namespace, lease_body(s, self.identity, None, take=True))
            else:
                self.api.replace(
                    kube.LEASES, s.namespace, s.name, lease_body(s, self.identity, lease, take=action == TAKE)
                )
        except Exception as e:  # a refused connection is urllib3's own error, not an OSError
            # 409: another candidate wrote first (or our read was old): look again next round.
            log.info("lease %s failed: %s", action, e)
            return False, s.retry_period
        if action != RENEW:
            log.info(
                "lease %s", "created" if action == CREATE else "taken over", extra={"identity": self.identity}
            )
        return True, 0.0

    def release(self) -> None:
        """On a clean stop: hand the lease back at once (holder emptied, as client-go's ReleaseOnCancel)."""
        s = self.settings
        with self._lock:
            try:
                self._release(s)
            except Exception as e:  # a refused connection is urllib3's own error, not an OSError
                log.warning("releasing the lease failed: %s", e)

    def _release(self, s: Settings) -> None:
        lease = self.api.get(kube.LEASES, s.namespace, s.name)
        if lease is None or holder_record(lease)[0] != self.identity:
            return  # released already (the cleanup handler and this thread both ask), or not ours
        body = lease_body(s, self.identity, lease, take=False)
        body["spec"].update(holderIdentity=None, leaseDurationSeconds=1)
        self.api.replace(kube.LEASES, s.namespace, s.name, body)
        log.info("lease released", extra={"identity": self.identity})
