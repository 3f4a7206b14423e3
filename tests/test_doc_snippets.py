"""The trainer snippets users copy from the READMEs are verbatim excerpts of examples/megatron/train.py,
which tests/test_demo_megatron.py runs end to end (real megatron-core, real SGLang): what a user copies is
code that ran. The SGLang command lines of those READMEs are the one examples/megatron/colocatejob.yaml runs.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "megatron" / "train.py"
JOB = ROOT / "examples" / "megatron" / "colocatejob.yaml"
DOCS = [ROOT / "README.md", ROOT / "examples" / "megatron" / "README.md"]


def blocks(path: Path, language: str) -> list[str]:
    text = path.read_text()
    found = re.findall(rf"^( *)```{language}\n(.*?)^\1```", text, flags=re.S | re.M)
    return [
        textwrap.dedent("\n".join(line[len(indent) :] for line in body.splitlines()))
        for indent, body in found
    ]


def is_excerpt(snippet: str, source: str) -> bool:
    wanted = textwrap.dedent(snippet).strip("\n").splitlines()
    lines = source.splitlines()
    return any(
        textwrap.dedent("\n".join(lines[i : i + len(wanted)])).splitlines() == wanted
        for i in range(len(lines) - len(wanted) + 1)
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_trainer_snippets_are_excerpts_of_the_example_that_runs(doc: Path) -> None:
    snippets = [s for s in blocks(doc, "python") if "publisher" in s.lower()]
    assert snippets, f"{doc} shows no trainer snippet"
    source = TRAINER.read_text()
    for snippet in snippets:
        assert is_excerpt(snippet, source), f"{doc}: this snippet is not in {TRAINER.name}:\n{snippet}"


def test_an_edited_snippet_is_caught() -> None:
    snippet = next(s for s in blocks(ROOT / "README.md", "python") if "publisher" in s.lower())
    assert not is_excerpt(snippet.replace("before_training()", "before_training(1)"), TRAINER.read_text())


def documented_command(doc: Path) -> list[str]:
    (command,) = [s for s in blocks(doc, "sh") if "sglang.launch_server" in s]
    return shlex.split(command.replace("\\\n", " "))


def test_the_documented_sglang_command_is_the_one_the_job_runs() -> None:
    job = yaml.safe_load(JOB.read_text())
    assert (
        documented_command(ROOT / "examples" / "megatron" / "README.md") == job["spec"]["rollout"]["command"]
    )
