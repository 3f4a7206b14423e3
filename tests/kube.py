"""Small helpers for integration tests against the local control plane."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

from colocate_devcluster import Cluster

T = TypeVar("T")


def get_json(cluster: Cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def wait_for(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll until probe() returns something truthy; fail with `what` and the last value after timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last value: {last!r}")
