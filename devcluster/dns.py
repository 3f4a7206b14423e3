"""The real node's cluster DNS, a STAND-IN for CoreDNS (not built here yet):
`kubernetes.default.svc[.cluster.local]` answers with the `kubernetes` Service's ClusterIP (which the node
routes to the apiserver); with `--api-server`, the names of other Services and of pods behind a headless
Service answer from the API:

- `<service>.<namespace>.svc.cluster.local`: the pod IPs of the Service's ready endpoints (its selector's
  Running, Ready pods; every Running one with publishNotReadyAddresses), as CoreDNS answers a headless
  Service. There is no kube-proxy on the node, so a ClusterIP would not route; answering with the pods'
  addresses is what lets in-cluster clients (the operator, the job's containers) reach the job's Redis.
- `<hostname>.<subdomain>.<namespace>.svc.cluster.local`: the pod with that hostname and subdomain.

Every other name is NXDOMAIN (the resolver then tries its next search domain). The API is read with the
node's own credentials (its kubelet's token: the system:node role reads Services and pods).

Run: `python -m colocate_devcluster.dns --listen 10.85.0.1:53 --record NAME=IP ... [--api-server URL --ca FILE
--token-file FILE]`."""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

CLUSTER_SUFFIX = ".svc.cluster.local"
TTL = 2  # seconds: a restarted pod's new address shows quickly
Resolver = Callable[[str], list[str] | None]  # a name -> its IPv4 addresses (empty: no data); None: NXDOMAIN


def parse_question(packet: bytes) -> tuple[str, int, int]:
    """(name, qtype, end offset of the question) of a query's first question."""
    labels, offset = [], 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype = struct.unpack("!H", packet[offset + 1 : offset + 3])[0]
    return ".".join(labels).lower(), qtype, offset + 5


def answer(packet: bytes, records: dict[str, str], resolve: Resolver | None = None) -> bytes:
    """The reply to one query: A records for a known name (a static record, else what `resolve` finds),
    NOERROR with no answer for its other types, NXDOMAIN for unknown names."""
    ident, flags = struct.unpack("!HH", packet[:4])
    name, qtype, end = parse_question(packet)
    question = packet[12:end]
    rd = flags & 0x0100
    name = name.rstrip(".")
    addresses: list[str] | None = [records[name]] if name in records else None
    if addresses is None and resolve is not None:
        addresses = resolve(name)
    if addresses is None:
        return struct.pack("!HHHHHH", ident, 0x8180 | rd | 3, 1, 0, 0, 0) + question
    if qtype != 1:  # A only; AAAA and the rest: the name exists, no data
        return struct.pack("!HHHHHH", ident, 0x8580 | rd, 1, 0, 0, 0) + question
    body = b"".join(b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, TTL, 4) + socket.inet_aton(a) for a in addresses)
    return struct.pack("!HHHHHH", ident, 0x8580 | rd, 1, len(addresses), 0, 0) + question + body


def _ready(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions", [])
    )


def addresses_from_api(name: str, get: Callable[[str], dict | None]) -> list[str] | None:
    """What CoreDNS would answer for `name` (a Service or a pod of a headless Service), from the API through
    `get(path) -> JSON or None when not found`. None: no such name."""
    if not name.endswith(CLUSTER_SUFFIX):
        return None
    parts = name[: -len(CLUSTER_SUFFIX)].split(".")
    if len(parts) not in (2, 3):
        return None
    *host, service_name, namespace = parts
    service = get(f"/api/v1/namespaces/{namespace}/services/{service_name}")
    if service is None:
        return None
    spec = service.get("spec", {})
    selector = spec.get("selector") or {}
    if not selector:
        return [] if not host else None
    query = urllib.parse.urlencode({"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())})
    pods = (get(f"/api/v1/namespaces/{namespace}/pods?{query}") or {}).get("items", [])
    live = [
        p
        for p in pods
        if p.get("status", {}).get("podIP")
        and p["status"].get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and (spec.get("publishNotReadyAddresses") or _ready(p))
    ]
    if host:
        live = [
            p
            for p in live
            if p["spec"].get("hostname") == host[0] and p["spec"].get("subdomain") == service_name
        ]
        return [p["status"]["podIP"] for p in live] or None
    return sorted(p["status"]["podIP"] for p in live)


class Api:
    """GETs against the apiserver with a bearer token; 404 is None. Answers are kept for TTL seconds."""

    def __init__(self, server: str, ca: str, token_file: str) -> None:
        self.server = server.rstrip("/")
        self.context = ssl.create_default_context(cafile=ca)
        with open(token_file) as f:
            self.token = f.read().strip()
        self.cache: dict[str, tuple[float, list[str] | None]] = {}

    def get(self, path: str) -> dict | None:
        request = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2, context=self.context) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            raise

    def resolve(self, name: str) -> list[str] | None:
        now = time.monotonic()
        cached = self.cache.get(name)
        if cached and now - cached[0] < TTL:
            return cached[1]
        try:
            found = addresses_from_api(name, self.get)
        except (OSError, ValueError) as err:  # the apiserver unreachable: no data, and say so
            print(f"lookup of {name} failed: {err}", flush=True)
            return []
        self.cache[name] = (now, found)
        return found


def serve(listen: str, records: dict[str, str], resolve: Resolver | None = None) -> None:
    host, port = listen.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, int(port)))
    while True:
        packet, peer = sock.recvfrom(512)
        try:
            sock.sendto(answer(packet, records, resolve), peer)
        except (IndexError, struct.error, UnicodeError):
            continue  # not a query we can read: no answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="colocate-devcluster-dns", description=__doc__)
    parser.add_argument("--listen", required=True, help="IP:port to answer on")
    parser.add_argument("--record", action="append", default=[], help="NAME=IPv4 (repeatable)")
    parser.add_argument("--api-server", help="https://host:port: answer Service and pod names from the API")
    parser.add_argument("--ca", help="the apiserver's CA certificate (with --api-server)")
    parser.add_argument("--token-file", help="a file holding the bearer token (with --api-server)")
    args = parser.parse_args(argv)
    records = dict(r.lower().split("=", 1) for r in args.record)
    api = Api(args.api_server, args.ca, args.token_file) if args.api_server else None
    print(
        f"answering {records} on {args.listen}{' and Services from ' + args.api_server if api else ''}",
        flush=True,
    )
    serve(args.listen, records, api.resolve if api else None)


if __name__ == "__main__":
    main()
