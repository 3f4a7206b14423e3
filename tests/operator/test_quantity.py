"""Our quantity parser agrees with the kubernetes client library's (the reference, installed for tests)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from kubernetes.utils.quantity import parse_quantity as reference

from colocate_operator.quantity import parse_quantity

SAMPLES = [
    "0",
    "1",
    "512Mi",
    "1Gi",
    "1.5Gi",
    "2Ti",
    "1Ei",
    "100m",
    "250u",
    "7n",
    "1k",
    "1.5G",
    "3M",
    "1T",
    "2P",
    "1E",
    "1e3",
    "1E3",
    "2.5e-3",
    "+5",
    "-5Mi",
    ".5",
    "64",
    "128974848",
    "129e6",
    "123Mi",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_agrees_with_the_kubernetes_library(text: str) -> None:
    assert parse_quantity(text) == reference(text)


def test_numbers_and_bad_text() -> None:
    assert parse_quantity(3) == Decimal(3) and parse_quantity(0.5) == Decimal("0.5")
    for bad in ("", "Mi", "1 Gi", "1GiB", "1.2.3", "e3", "1Mb"):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            parse_quantity(bad)
