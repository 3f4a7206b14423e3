"""Heartbeats (our own, refreshed by a thread) and peer watches (is the other side alive?).

A peer is dead only when its heartbeat has not been seen for a whole TTL, measured on our clock while Redis
answered, and, when it runs on our host, its process is gone. A single missing read (Redis just restarted and
lost the key, which the peer rewrites within a quarter TTL) is never taken for a death: freeing a bucket that
a live reader still maps is the failure this protocol exists to prevent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from colocate_runtime.colocated.metastore import MetaStore, MetaStoreError

log = logging.getLogger(__name__)


def host_id() -> str:
    return socket.gethostname()


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs here (a zombie counts as gone: its mappings are released)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (OSError, IndexError):
        return False


class Heartbeat:
    """Refreshes `hb:{role}:{uuid}` every quarter TTL on a daemon thread until stopped."""

    def __init__(
        self,
        store: MetaStore,
        role: str,
        uuid: str,
        ttl_s: float,
        info: Callable[[], dict[str, Any]],
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.role, self.uuid, self.ttl_s = store, role, uuid, ttl_s
        self._info = info
        self._on_beat = on_beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"colocate-heartbeat-{role}", daemon=True)
        self._failures = 0

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        info = {"pid": os.getpid(), "host": host_id(), "t": time.time(), **self._info()}
        self.store.heartbeat(self.role, self.uuid, info, self.ttl_s)
        if self._on_beat is not None:
            self._on_beat()

    def _run(self) -> None:
        period = max(0.05, min(self.ttl_s / 4, 2.0))
        while not self._stop.wait(period):
            try:
                self.beat()
                self._failures = 0
            except MetaStoreError as err:
                self._failures += 1
                if self._failures in (1, 10, 100):
                    log.warning(
                        "heartbeat %s/%s not written (%d in a row): %s",
                        self.role,
                        self.uuid,
                        self._failures,
                        err,
                    )
            except Exception:  # the heartbeat must outlive any surprise
                log.exception("heartbeat %s/%s failed", self.role, self.uuid)

    def stop(self, *, drop: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if drop:
            with contextlib.suppress(MetaStoreError):
                self.store.drop_heartbeat(self.role, self.uuid)


class PeerWatch:
    """Tracks the heartbeat of the peer on the same GPU; `check()` at every wake of a wait loop."""

    def __init__(self, store: MetaStore, role: str, uuid: str, ttl_s: float) -> None:
        self.store, self.role, self.uuid, self.ttl_s = store, role, uuid, ttl_s
        self.started = time.monotonic()
        self.last_seen: float | None = None
        self.last_info: dict[str, Any] | None = None

    def check(self) -> None:
        """Read the heartbeat once (raises MetaStoreUnavailable when Redis does not answer)."""
        info = self.store.read_heartbeat(self.role, self.uuid)
        if info is not None:
            self.last_seen = time.monotonic()
            self.last_info = info

    @property
    def ever_seen(self) -> bool:
        return self.last_seen is not None

    def silent_for(self) -> float:
        return time.monotonic() - (self.last_seen if self.last_seen is not None else self.started)

    def dead(self) -> bool:
        """Silent for a whole TTL, and (when the peer runs on this host) its process is gone."""
        if self.silent_for() < self.ttl_s:
            return False
        info = self.last_info
        if info is not None and info.get("host") == host_id():
            return process_gone(int(info.get("pid", 0)))
        return True
