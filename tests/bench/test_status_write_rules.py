"""The status-write bench's CRD variants (issue 35): which CEL rules each takes out of the shipped CRD."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.scale.source import snapshot
from bench.scale.status_write_bench import crd_without, spec_schema


def shipped() -> dict[str, Any]:
    return yaml.safe_load(snapshot("worktree", Path()).crd.read_text())


def spec_rules(crd: dict[str, Any]) -> list[str]:
    return [rule["rule"] for rule in spec_schema(crd).get("x-kubernetes-validations", [])]


def all_rules(crd: dict[str, Any]) -> int:
    return json.dumps(crd).count('"x-kubernetes-validations"')


def test_all_keeps_the_shipped_crd() -> None:
    assert crd_without(shipped(), "all") == shipped()


def test_transition_takes_out_only_the_spec_rules_reading_old_self() -> None:
    before, after = spec_rules(shipped()), spec_rules(crd_without(shipped(), "transition"))
    assert len([r for r in before if "oldSelf" in r]) == 3
    assert after == [r for r in before if "oldSelf" not in r]
    assert all_rules(crd_without(shipped(), "transition")) == all_rules(shipped())  # the fields' own stay


def test_spec_takes_out_specs_own_rules_and_none_takes_out_every_rule() -> None:
    no_spec = crd_without(shipped(), "spec")
    assert spec_rules(no_spec) == [] and all_rules(no_spec) == all_rules(shipped()) - 1
    assert all_rules(crd_without(shipped(), "none")) == 0


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="--rules must be one of"):
        crd_without(shipped(), "some")
