"""Args and commands may not reference the secret variables (issue 30, item 9): the kubelet expands `$(VAR)`
in a container's command and args into its command line, which every process on the node can read
(/proc/<pid>/cmdline). The CRD's CEL rules refuse it, naming the field; `$$(VAR)` (a literal) and the other
variables stay allowed. On the real API server (dry-run creates)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from colocate_runtime.contract import env
from tests.operator.test_integration import job_manifest

CRD = Path(__file__).resolve().parents[2] / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"

REFUSED = [
    ("trainer", "args", ["--redis-password=$(COLOCATE_METASTORE_PASSWORD)"]),
    ("trainer", "command", ["sh", "-c", "echo $(SGLANG_API_KEY)"]),
    ("rollout", "args", ["--api-key", "$(SGLANG_API_KEY)"]),
    ("rollout", "command", ["run", "x$$$(COLOCATE_METASTORE_PASSWORD)"]),  # `$$` then an expanded `$(...)`
]
ALLOWED = [
    ["$$(COLOCATE_METASTORE_PASSWORD)"],  # escaped: the process sees the literal text
    ["--job", "$(COLOCATE_JOB_NAME)", "--addr=$(COLOCATE_METASTORE_ADDR)"],
    ["sh", "-c", 'exec serve --key "$SGLANG_API_KEY"'],  # read by the shell from the environment
]


def secret_rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    rules = spec["spec"]["x-kubernetes-validations"]
    return [r for r in rules if "COLOCATE_METASTORE_PASSWORD" in r["rule"]]


def test_the_rules_cover_every_secret_variable_of_the_contract_in_both_containers() -> None:
    rules = secret_rules()
    assert sorted(r["fieldPath"] for r in rules) == [
        ".rollout.args",
        ".rollout.command",
        ".trainer.args",
        ".trainer.command",
    ]
    secret_names = {var.name for var in env.TABLE if var.secret}
    for rule in rules:
        (alternatives,) = re.findall(r"\[\(\]\(([A-Z_|]+)\)\[\)\]", rule["rule"])
        assert set(alternatives.split("|")) == secret_names
        assert rule["message"].startswith(f"spec{rule['fieldPath']} must not reference")


def dry_run(cluster: Any, manifest: dict[str, Any]) -> Any:
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)


@pytest.mark.integration
def test_references_to_secret_variables_in_args_are_refused_naming_the_field(
    cluster: Any, crd: Path, namespace: str
) -> None:
    for container, field, value in REFUSED:
        manifest = job_manifest("cel-args", namespace, gpusPerNode=1, **{container: {field: value}})
        refused = dry_run(cluster, manifest)
        assert refused.returncode != 0, f"spec.{container}.{field}={value} was accepted"
        assert f"spec.{container}.{field}" in refused.stderr and "command line" in refused.stderr, (
            refused.stderr
        )
    for value in ALLOWED:
        manifest = job_manifest("cel-args", namespace, gpusPerNode=1, trainer={"args": value})
        accepted = dry_run(cluster, manifest)
        assert accepted.returncode == 0, accepted.stderr
