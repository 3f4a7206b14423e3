"""The smallest cluster DNS a real node's pods need: `kubernetes.default.svc[.cluster.local]` answers with
the `kubernetes` Service's ClusterIP (which the node routes to the apiserver); every other name is
NXDOMAIN. In-cluster clients that name the apiserver by DNS (kopf's service-account login does) work
without CoreDNS. Run: `python -m colocate_devcluster.dns --listen 10.85.0.1:53 --record NAME=IP ...`."""

from __future__ import annotations

import argparse
import socket
import struct


def parse_question(packet: bytes) -> tuple[str, int, int]:
    """(name, qtype, end offset of the question) of a query's first question."""
    labels, offset = [], 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype = struct.unpack("!H", packet[offset + 1 : offset + 3])[0]
    return ".".join(labels).lower(), qtype, offset + 5


def answer(packet: bytes, records: dict[str, str]) -> bytes:
    """The reply to one query: an A record for a known name, NOERROR with no answer for its other types,
    NXDOMAIN for unknown names."""
    ident, flags = struct.unpack("!HH", packet[:4])
    name, qtype, end = parse_question(packet)
    question = packet[12:end]
    rd = flags & 0x0100
    address = records.get(name.rstrip("."))
    if address is None:
        return struct.pack("!HHHHHH", ident, 0x8180 | rd | 3, 1, 0, 0, 0) + question
    if qtype != 1:  # A only; AAAA and the rest: the name exists, no data
        return struct.pack("!HHHHHH", ident, 0x8580 | rd, 1, 0, 0, 0) + question
    record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(address)
    return struct.pack("!HHHHHH", ident, 0x8580 | rd, 1, 1, 0, 0) + question + record


def serve(listen: str, records: dict[str, str]) -> None:
    host, port = listen.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, int(port)))
    while True:
        packet, peer = sock.recvfrom(512)
        try:
            sock.sendto(answer(packet, records), peer)
        except (IndexError, struct.error, UnicodeError):
            continue  # not a query we can read: no answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="colocate-devcluster-dns", description=__doc__)
    parser.add_argument("--listen", required=True, help="IP:port to answer on")
    parser.add_argument("--record", action="append", default=[], help="NAME=IPv4 (repeatable)")
    args = parser.parse_args(argv)
    records = dict(r.lower().split("=", 1) for r in args.record)
    print(f"answering {records} on {args.listen}", flush=True)
    serve(args.listen, records)


if __name__ == "__main__":
    main()
