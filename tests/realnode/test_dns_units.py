"""The real node's DNS stand-in without a cluster: Service and pod names answered from API objects."""

from __future__ import annotations

import socket
import struct

from colocate_devcluster import dns


def _pod(name: str, ip: str, *, ready: bool = True, hostname: str = "", subdomain: str = "") -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"hostname": hostname, "subdomain": subdomain},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


OBJECTS = {
    "/api/v1/namespaces/ns/services/store": {"spec": {"selector": {"app": "redis"}}},
    "/api/v1/namespaces/ns/services/workers": {
        "spec": {"clusterIP": "None", "selector": {"app": "w"}, "publishNotReadyAddresses": True}
    },
    "/api/v1/namespaces/ns/pods?labelSelector=app%3Dredis": {
        "items": [_pod("r1", "10.85.3.7"), _pod("r2", "10.85.3.8", ready=False)]
    },
    "/api/v1/namespaces/ns/pods?labelSelector=app%3Dw": {
        "items": [_pod("w0", "10.85.3.9", ready=False, hostname="job-0", subdomain="workers")]
    },
}


def get(path: str) -> dict | None:
    return OBJECTS.get(path)


def test_a_service_answers_with_its_ready_pods_addresses() -> None:
    assert dns.addresses_from_api("store.ns.svc.cluster.local", get) == ["10.85.3.7"]
    # publishNotReadyAddresses: every running pod, and a pod by its hostname and subdomain
    assert dns.addresses_from_api("workers.ns.svc.cluster.local", get) == ["10.85.3.9"]
    assert dns.addresses_from_api("job-0.workers.ns.svc.cluster.local", get) == ["10.85.3.9"]


def test_unknown_names_are_nxdomain() -> None:
    for name in (
        "nope.ns.svc.cluster.local",
        "job-1.workers.ns.svc.cluster.local",
        "store.ns.svc.cluster.local.ns.svc.cluster.local",  # a search-domain expansion
        "pypi.org",
    ):
        assert dns.addresses_from_api(name, get) is None, name


def test_answer_carries_every_address() -> None:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in ["store", "ns", "svc", "cluster", "local"])
    query = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", 1, 1)
    reply = dns.answer(query, {}, lambda name: ["10.85.3.7", "10.85.3.8"])
    assert struct.unpack("!HHHH", reply[:8])[3] == 2
    assert [socket.inet_ntoa(reply[-20:-16]), socket.inet_ntoa(reply[-4:])] == ["10.85.3.7", "10.85.3.8"]
    assert struct.unpack("!H", dns.answer(query, {}, lambda name: None)[2:4])[0] & 0xF == 3
