"""The CRD file: names, documentation, defaults (against the operator's models), printer columns, rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from colocate_operator.constants import GROUP, KIND, PLURAL, SHORT_NAME, VERSION, Cond, Phase
from colocate_operator.spec import ColocateJobSpec
from tests.operator import factories

CRD_PATH = Path(__file__).resolve().parents[2] / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (only,) = crd["spec"]["versions"]
    return only


def _walk(node: Any, path: str):
    if isinstance(node, dict):
        yield path, node
        for key, child in (node.get("properties") or {}).items():
            yield from _walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_names(crd: dict[str, Any], version: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert (crd["spec"]["group"], version["name"], names["kind"], names["plural"]) == (
        GROUP,
        VERSION,
        KIND,
        PLURAL,
    )
    assert SHORT_NAME in names["shortNames"]
    assert version["subresources"] == {"status": {}}
    assert version["served"] and version["storage"]


def test_every_field_is_documented(version: dict[str, Any]) -> None:
    schema = version["schema"]["openAPIV3Schema"]
    undocumented = [
        path
        for path, node in _walk(schema, "")
        if path not in ("", ".metadata") and not path.endswith(("{}", "[]")) and not node.get("description")
    ]
    assert undocumented == []


def test_printer_columns(version: dict[str, Any]) -> None:
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Step", "Ready", "Restarts", "KL", "Consistent", "Age"]
    assert columns["Consistent"] == '.status.conditions[?(@.type=="RolloutConsistent")].status'
    assert columns["Step"] == ".status.weightSync.lastCompletedStep"
    assert columns["Phase"] == ".status.phase"
    assert columns["Restarts"] == ".status.restarts"


def test_status_schema_has_weight_sync_fields(version: dict[str, Any]) -> None:
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["weightSync"]["properties"]) >= {
        "lastCompletedStep",
        "weightVersion",
        "lastSyncSeconds",
        "lastSyncBytes",
        "currentPhase",
    }
    ring = status["recentSteps"]
    assert ring["type"] == "array" and ring["maxItems"] >= 1
    assert set(ring["items"]["properties"]) >= {"step", "result", "syncSeconds", "bytes", "completionTime"}
    assert tuple(status["phase"]["enum"]) == Phase.ALL
    assert status["conditions"]["x-kubernetes-list-type"] == "map"


def test_every_rule_message_names_a_field(version: dict[str, Any]) -> None:
    rules = [
        (path, rule)
        for path, node in _walk(version["schema"]["openAPIV3Schema"], "")
        for rule in node.get("x-kubernetes-validations") or []
    ]
    assert len(rules) >= 15
    for path, rule in rules:
        message = rule["message"]
        named = "spec." in message or "metadata." in message or "env" in message or "GPUs" in message
        assert named, f"{path}: {message!r} does not name its field"


def _defaults(schema: dict[str, Any], path: tuple[str, ...] = ()):
    for key, child in (schema.get("properties") or {}).items():
        if "default" in child and not isinstance(child["default"], dict):
            yield (*path, key), child["default"]
        yield from _defaults(child, (*path, key))


def test_model_defaults_match_the_crd(version: dict[str, Any]) -> None:
    """The pydantic models repeat the CRD's defaults; builders tested from minimal specs rely on that."""
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    dumped = ColocateJobSpec.model_validate(factories.spec()).model_dump(by_alias=True)
    checked = 0
    for path, default in _defaults(spec_schema):
        if path[:2] == ("metaStore", "external"):
            continue  # only present in External mode
        value: Any = dumped
        for part in path:
            value = value[part]
        assert value == default, f"spec.{'.'.join(path)}: model {value!r} != CRD {default!r}"
        checked += 1
    assert checked >= 20


def test_ipc_preflight_field_and_condition(version: dict[str, Any]) -> None:
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    preflight = schema["spec"]["properties"]["weightSync"]["properties"]["ipcPreflight"]
    assert preflight["default"] == {}
    assert preflight["properties"]["mode"]["enum"] == ["Wait", "Fail", "Off"]  # "Off" quoted: not YAML false
    assert preflight["properties"]["mode"]["default"] == "Wait"
    assert preflight["properties"]["timeoutSeconds"]["default"] == 60
    assert "IPCReady" in schema["status"]["properties"]["conditions"]["description"]
    assert Cond.IPC_READY in Cond.ALL and Cond.IPC_READY not in Cond.RECONCILED
    assert len(Cond.ALL) <= schema["status"]["properties"]["conditions"]["maxItems"]
