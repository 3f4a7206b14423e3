"""The status model (status.py) against the CRD's status schema, and the owned keys derived from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from colocate_operator.constants import Cond
from colocate_operator.status import (
    CONDITION_OWNERS,
    RECONCILER_KEYS,
    STEP_KEYS,
    EnginesPart,
    JobStatus,
    Owner,
    StatusView,
    SuspensionStatus,
    owners,
    reconciler_status,
    status_patch,
    with_fields,
    with_part,
)

CRD = Path(__file__).resolve().parents[2] / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"


def crd_status() -> dict[str, Any]:
    version = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]


def model_keys(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """Each field's key as written, with its nested model (None for a scalar or a list of scalars)."""
    keys: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        nested = None
        for candidate in _types(info.annotation):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                nested = candidate
        keys[info.alias or name] = nested
    return keys


def _types(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types(a)]


def compare(schema: dict[str, Any], model: type[BaseModel], path: str) -> list[str]:
    if schema.get("type") == "array":
        schema = schema["items"]
    props = schema.get("properties") or {}
    keys = model_keys(model)
    problems = [f"{path}.{k}: in the CRD, not in status.py" for k in sorted(set(props) - set(keys))]
    problems += [f"{path}.{k}: in status.py, not in the CRD" for k in sorted(set(keys) - set(props))]
    for key, nested in keys.items():
        if nested is not None and key in props:
            problems += compare(props[key], nested, f"{path}.{key}")
    return problems


def test_the_model_is_the_crds_status_schema() -> None:
    assert compare(crd_status(), JobStatus, "status") == []


def test_every_key_has_an_owner_and_only_conditions_have_two() -> None:
    for name in JobStatus.model_fields:
        assert owners(name), f"status.{name} has no owner"
    assert set(RECONCILER_KEYS) & set(STEP_KEYS) == {"conditions"}
    assert {"weightSync", "recentSteps"} <= set(STEP_KEYS) and "phase" in RECONCILER_KEYS
    assert set(CONDITION_OWNERS) == set(Cond.ALL)
    assert {t for t, o in CONDITION_OWNERS.items() if o == Owner.RECONCILER} == set(Cond.RECONCILED)


def test_the_reconcilers_patch_leaves_the_step_followers_keys_alone() -> None:
    current = {"phase": "Pending", "weightSync": {"lastCompletedStep": 4}, "recentSteps": [{"step": 4}]}
    assert status_patch(current, {"phase": "Running", "restarts": 0}) == {"phase": "Running", "restarts": 0}
    assert status_patch({"startTime": "t"}, {})["startTime"] is None  # merge-patch null removes it
    with pytest.raises(ValueError, match="weightSync"):
        status_patch(current, {"weightSync": {"lastCompletedStep": 5}})


def test_a_status_as_written_parses() -> None:
    status = JobStatus.of(
        {
            "phase": "Running",
            "restarts": 2,
            "weightSync": {"currentPhase": "Rollout", "lastCompletedStep": 7, "finalStepRecorded": True},
            "conditions": [{"type": "PodsReady", "status": "True", "reason": "AllPodsReady"}],
        }
    )
    assert status.restarts == 2 and status.weight_sync is not None
    assert status.weight_sync.final_step_recorded is True


def test_the_view_reads_what_other_modules_ask_of_a_status() -> None:
    view = StatusView.of(
        {
            "status": {
                "phase": "Running",
                "restarts": 3,
                "groupCreated": True,
                "weightSync": {"finalStepRecorded": True},
                "conditions": [{"type": "IPCReady", "status": "False", "reason": "ShmNotShared"}],
            }
        }
    )
    assert (view.phase, view.restarts, view.group_created, view.final_step_recorded) == (
        "Running",
        3,
        True,
        True,
    )
    assert (view.condition("IPCReady") or {}).get("reason") == "ShmNotShared"
    assert view.condition("PodsReady") is None
    empty = StatusView.of({})
    assert (empty.phase, empty.restarts, empty.group_created, empty.final_step_recorded) == (
        None,
        0,
        False,
        False,
    )


def test_the_view_reads_what_decide_asks_of_a_status() -> None:
    view = StatusView(
        {
            "startTime": "2026-11-30T12:00:00Z",
            "suspension": {"requestTime": "t0", "checkpointRequested": True, "afterStep": 4},
            "engineRestarts": 0,
            "weightSync": {"currentPhase": "Copied", "lastCompletedStep": 4},
            "conditions": [{"type": "PodsReady", "status": "True"}],
        }
    )
    assert (view.start_time, view.last_restart_time, view.completion_time) == (
        "2026-11-30T12:00:00Z",
        None,
        None,
    )
    assert view.suspension == SuspensionStatus(request_time="t0", checkpoint_requested=True, after_step=4)
    # A count of zero is still a count (written on); an absent one is not written.
    assert (view.engine_restarts, view.engine_restarts_counted) == (0, None)
    assert (view.sync_phase, view.last_completed_step) == ("Copied", 4)
    assert view.conditions == [{"type": "PodsReady", "status": "True"}]
    empty = StatusView({})
    assert (empty.suspension, empty.sync_phase, empty.last_completed_step, empty.conditions) == (
        None,
        None,
        None,
        [],
    )


def test_the_reconcilers_desired_status_is_written_camel_case_without_nones() -> None:
    status = with_fields(JobStatus(), phase="Running", group_created=True, start_time="t")
    status = with_part(status, EnginesPart(engine_restarts=0))
    conditions = [{"type": "PodsReady", "status": "True", "reason": "AllPodsReady"}]
    assert reconciler_status(status, conditions) == {
        "phase": "Running",
        "restarts": 0,
        "groupCreated": True,
        "startTime": "t",
        "engineRestarts": 0,
        "conditions": conditions,  # passed through as merged: other writers' conditions untouched
    }
    with pytest.raises(ValueError, match="no status fields"):
        with_fields(status, groupCreated=True)
    with pytest.raises(ValueError):
        with_fields(status, restarts="many")
