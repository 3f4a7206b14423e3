"""Kubernetes resource quantities ("512Mi", "1.5G", "100m", "1e3") as exact Decimals.

The same grammar as the API server's: a signed decimal number, an optional exponent, then one suffix,
binary (Ki ... Ei) or decimal (n, u, m, k, M ... E). Written here because the kubernetes client library's
`parse_quantity` would load the whole library (kubeauth.py keeps it out of the operator).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    **{s: Decimal(2) ** (10 * i) for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9))},
    **{s: Decimal(10) ** e for s, e in (("T", 12), ("P", 15), ("E", 18))},
}
# An exponent needs digits after the e, so "1E" is one exa and "1e3" one thousand, as in Kubernetes.
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")


def parse_quantity(quantity: str | int | float) -> Decimal:
    if isinstance(quantity, int | float) and not isinstance(quantity, bool):
        return Decimal(str(quantity))
    match = _QUANTITY.fullmatch(str(quantity).strip())
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity (e.g. 512Mi, 1.5G, 100m)")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity") from None
