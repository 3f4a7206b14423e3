"""Feature gates and runtime-config of the local control plane: off by default, passed to the apiserver,
controller-manager and scheduler alike, refused when malformed (the real plane with them on:
tests/operator/test_gang_integration.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocate_devcluster import GANG_SCHEDULING, ClusterError, ClusterSpec


def test_no_gates_by_default(tmp_path: Path) -> None:
    spec = ClusterSpec(workdir=tmp_path)
    assert spec.feature_gates == () and spec.runtime_config == () and spec.gate_args == ()


def test_the_gang_scheduling_preset(tmp_path: Path) -> None:
    spec = ClusterSpec(workdir=tmp_path, **GANG_SCHEDULING)
    assert spec.gate_args == ("--feature-gates=GenericWorkload=true",)
    assert spec.runtime_config == ("scheduling.k8s.io/v1beta1=true",)
    both = ClusterSpec(
        workdir=tmp_path, feature_gates=("GenericWorkload=true", "ContainerRestartRules=false")
    )
    assert both.gate_args == ("--feature-gates=GenericWorkload=true,ContainerRestartRules=false",)


@pytest.mark.parametrize("gate", ["GenericWorkload", "GenericWorkload=yes", "a b=true", "=true"])
def test_a_malformed_gate_is_refused(tmp_path: Path, gate: str) -> None:
    with pytest.raises(ClusterError, match="Name=true or Name=false"):
        ClusterSpec(workdir=tmp_path, feature_gates=(gate,))
