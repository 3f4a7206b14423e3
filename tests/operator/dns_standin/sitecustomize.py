"""A cluster-DNS stand-in for end-to-end tests on the local plane: kwok runs no pods and this machine has no
cluster DNS, so a Service name under `.svc.cluster.local` resolves to `COLOCATE_TEST_SERVICE_IP`, a loopback
address where the test runs the real server that stands in for the Service's pod. Python loads this module at
start in every process whose PYTHONPATH names this folder; without the variable it changes nothing."""

from __future__ import annotations

import os
import socket

_IP = os.environ.get("COLOCATE_TEST_SERVICE_IP")
_SUFFIX = ".svc.cluster.local"

if _IP:
    _resolve = socket.getaddrinfo

    def _getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.rstrip(".").endswith(_SUFFIX):
            host = _IP
        return _resolve(host, *args, **kwargs)

    socket.getaddrinfo = _getaddrinfo
