"""docs/fp8.md: its job snippet is a valid ColocateJob (the operator's own spec model and the CRD's enum), and
its command lines are the benches' real options."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from tests.operator import factories

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fp8.md"
CRD = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def test_the_job_snippet_parses_as_the_operator_reads_it() -> None:
    (snippet,) = blocks("yaml")
    fragment = yaml.safe_load(snippet)["spec"]
    job = factories.job(**fragment)
    assert job.spec.weight_sync.rollout_weights == "BlockFP8"
    crd = yaml.safe_load(CRD.read_text())
    weight_sync = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "weightSync"
    ]
    assert fragment["weightSync"]["rolloutWeights"] in weight_sync["properties"]["rolloutWeights"]["enum"]


def test_the_bench_command_lines_name_the_benches_real_options() -> None:
    """Read from the benches' sources (importing them costs a torch import each): every option is one of
    their `add_argument` names and every value a string they define (a choice or a preset name)."""
    (commands,) = blocks("bash")
    for line in commands.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "python"
        source = (ROOT / argv[1]).read_text()
        for arg in argv[2:]:
            quoted = f'"{arg}"'
            assert quoted in source, f"{arg} is not an option or a value of {argv[1]}"
