"""Fixtures for the operator's integration tests: the CRD installed once, the operator as a subprocess that
runs under the Helm chart's own ServiceAccount and RBAC (not as cluster admin), so a verb the chart lacks
fails a test: the request is refused, and the fixture fails any test whose operator log shows a refusal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from colocate_devcluster import Cluster
from colocate_devcluster.kueue import Kueue
from tests.kube import ChartIdentity, chart_identity, forbidden_lines
from tests.operator import kueue_setup
from tests.operator.harness import TEST_CHART_VALUES, OperatorProcess, install_crd


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> Path:
    return install_crd(cluster)


@pytest.fixture
def operator_identity(cluster: Cluster, crd: Path, namespace: str, tmp_path: Path) -> ChartIdentity:
    """The chart's ServiceAccount, RBAC for this test's namespace, and a token for it."""
    return chart_identity(cluster, namespace, tmp_path, *TEST_CHART_VALUES)


@pytest.fixture
def operator_process(
    namespace: str, tmp_path: Path, operator_identity: ChartIdentity
) -> Iterator[OperatorProcess]:
    """A started operator for this test's namespace; stopped (and its log printed on failure) afterwards.
    A request the chart's RBAC refused fails the test even when the operator survived it."""
    process = OperatorProcess(namespace, tmp_path / "operator.log", operator_identity).start()
    yield process
    process.stop()
    print(f"\n[operator log: {process.log_path}]\n{process.log()[-3000:]}", file=sys.stderr)
    refused = forbidden_lines(process.log())
    assert not refused, "the chart's RBAC refused the operator:\n" + "\n".join(refused[:10])


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Kueue:
    """Kueue for this session's cluster, started by the first module that asks and left running with it."""
    return kueue_setup.started_kueue(cluster)


@pytest.fixture
def quota(cluster: Cluster, kueue: Kueue, namespace: str) -> Iterator[kueue_setup.Quota]:
    """Quota for exactly one job in the test's namespace; removed, jobs first, while Kueue still runs."""
    yield from kueue_setup.quota_for(cluster, namespace)
