"""The External meta-store addresses the operator may dial, and so send a job's Redis password to.

A job's `metaStore.external.address` is chosen by whoever may create the job. The operator follows the
job's step stream there with the password from the job's Secret, so without a limit a tenant could aim the
operator (its network position, the NetworkPolicies that admit it) at any host and port. The operator's
administrator lists the addresses that are meta-stores; anything else is refused before a Secret is read.

Addresses are compared as written, never resolved: a resolved name could change between check and dial.
A name must be fully qualified (or be an IP): `redis.shared.svc` or `redis` would be completed by each pod's
DNS search path, so the same entry would name a different Service in every tenant's namespace. A name is taken
as fully qualified when it ends with a dot, or has at least three labels and does not end in `.svc` (write
`redis.shared.svc.cluster.local`); an entry that is not is refused, naming it, when the operator starts.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_HOST = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.?$")


def fully_qualified(name: str) -> bool:
    """An IP literal, a name ending with a dot, or one of three or more labels not ending in `.svc`."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name.endswith("."):
        return True
    labels = name.split(".")
    return len(labels) >= 3 and labels[-1] != "svc"


def _not_qualified(entry: str, host: str) -> ValueError:
    return ValueError(
        f"{entry!r}: {host!r} is not a fully qualified name or an IP address; a short name is completed by "
        "each pod's DNS search path, so it would name a different host in every namespace (write e.g. "
        "redis.shared.svc.cluster.local, or end the name with a dot)"
    )


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AddressRule:
    """One entry: `*`, `host[:port]`, `*.domain[:port]`, or a CIDR (addresses written as IP literals)."""

    text: str
    host: str | None = None  # exact name or IP literal, lower-case
    suffix: str | None = None  # ".domain" of a `*.domain` entry
    network: IPNetwork | None = None
    port: int | None = None  # None: any port

    @classmethod
    def parse(cls, entry: str) -> AddressRule:
        text = entry.strip().lower()
        if text == "*":
            return cls(text)
        if "/" in text:
            try:
                return cls(text, network=ipaddress.ip_network(text, strict=False))
            except ValueError:
                raise ValueError(f"{entry!r} is not a CIDR such as 10.0.0.0/8") from None
        host, port = text, None
        if text.count(":") == 1:
            host, _, digits = text.partition(":")
            if not digits.isdigit() or not 1 <= int(digits) <= 65535:
                raise ValueError(f"{entry!r} has no port from 1 to 65535 after its colon")
            port = int(digits)
        if host.startswith("*."):
            if not _HOST.match(host[2:]):
                raise ValueError(f"{entry!r}: {host[2:]!r} is not a DNS name")
            # What is under the domain has one label more: the domain needs two (example.com, not com).
            if not fully_qualified("x." + host[2:]):
                raise _not_qualified(entry, host[2:])
            return cls(text, suffix=host[1:], port=port)
        if not _HOST.match(host):
            raise ValueError(f"{entry!r} is not host, host:port, *.domain, a CIDR or *")
        if not fully_qualified(host):
            raise _not_qualified(entry, host)
        return cls(text, host=host, port=port)

    def matches(self, host: str, port: int) -> bool:
        if self.text == "*":
            return True
        if self.network is not None:
            try:
                return ipaddress.ip_address(host) in self.network
            except ValueError:
                return False  # a name: only name entries can allow it
        if self.port is not None and port != self.port:
            return False
        if self.suffix is not None:
            return host.endswith(self.suffix)
        return host == self.host


@dataclass(frozen=True)
class AddressAllowList:
    rules: tuple[AddressRule, ...] = ()

    @classmethod
    def parse(cls, text: str) -> AddressAllowList:
        """Comma-separated entries; ValueError naming the first bad one."""
        return cls(tuple(AddressRule.parse(e) for e in text.split(",") if e.strip()))

    def allows(self, address: str) -> bool:
        """`address` is `host:port` (the CRD's pattern); anything else is refused."""
        host, sep, port = address.strip().lower().rpartition(":")
        if not sep or not host or not port.isdigit():
            return False
        return any(rule.matches(host, int(port)) for rule in self.rules)

    def __str__(self) -> str:
        return ",".join(rule.text for rule in self.rules) or "(none)"
