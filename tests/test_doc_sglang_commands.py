"""The SGLang command lines of docs/sglang.md are the ones the tests run.

"The command line" shows a generic deployment (a model path, `--tp-size 4`);
examples/megatron/colocatejob.yaml is the job that `make demo DEMO_ARGS="--example megatron"` and
tests/test_demo_megatron.py run with real SGLang. The two may differ in values (model path, TP size) and the
job has flags of its own (host, port, `--load-format dummy`), so what is compared is the flag set: the same
launcher module, every documented flag in the job's command, and the same loader entry points after one
`--custom-weight-loader`, with `--enable-memory-saver`. The API-key launcher line ("API key") names the
module tests/sglang_real/test_serve_api_key.py starts real SGLang through, and no flag the job lacks.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "sglang.md"
JOB = ROOT / "examples" / "megatron" / "colocatejob.yaml"
SERVE_TEST = ROOT / "tests" / "sglang_real" / "test_serve_api_key.py"
LOADER_FLAG = "--custom-weight-loader"


def section(text: str, heading: str) -> str:
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if match is None:
        raise LookupError(f"no section {heading!r}")
    return match.group(1)


def sh_commands(text: str, module: str) -> list[list[str]]:
    """The `sh` blocks (indented ones too) that run `python -m <module>`, as argv."""
    found = re.findall(r"^( *)```sh\n(.*?)^\1```", text, flags=re.S | re.M)
    bodies = [textwrap.dedent(body) for _, body in found]
    return [shlex.split(b.replace("\\\n", " ")) for b in bodies if f"python -m {module}" in b]


def flags(argv: list[str]) -> set[str]:
    return {token for token in argv if token.startswith("--")}


def loaders(argv: list[str]) -> list[str]:
    """The names after the last `--custom-weight-loader` (SGLang keeps only the last one)."""
    at = len(argv) - 1 - argv[::-1].index(LOADER_FLAG)
    names = []
    for token in argv[at + 1 :]:
        if token.startswith("--"):
            break
        names.append(token)
    return names


def job_command() -> list[str]:
    return [str(token) for token in yaml.safe_load(JOB.read_text())["spec"]["rollout"]["command"]]


def check_command_line(text: str) -> None:
    (documented,) = sh_commands(section(text, "## The command line"), "sglang.launch_server")
    job = job_command()
    assert documented[:3] == job[:3] == ["python", "-m", "sglang.launch_server"]
    assert flags(documented) <= flags(job), f"flags the job does not run: {flags(documented) - flags(job)}"
    assert "--enable-memory-saver" in flags(documented)
    assert documented.count(LOADER_FLAG) == job.count(LOADER_FLAG) == 1
    assert (
        loaders(documented)
        == loaders(job)
        == [
            "colocate_runtime.sglang.loader.load_colocated_step",
            "colocate_runtime.sglang.loader.start_colocated",
        ]
    )


def test_the_documented_command_line_is_the_jobs_flag_set() -> None:
    check_command_line(DOC.read_text())


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("  --enable-memory-saver \\\n", ""),
        ("colocate_runtime.sglang.loader.start_colocated\n```", "colocate_runtime.sglang.loader.start\n```"),
        ("--tp-size 4", "--tensor-parallel 4"),
    ],
    ids=["no-memory-saver", "another-loader", "a-flag-the-job-lacks"],
)
def test_an_edited_command_line_is_caught(old: str, new: str) -> None:
    text = DOC.read_text()
    assert text.count(old) == 1
    with pytest.raises(AssertionError):
        check_command_line(text.replace(old, new))


def test_the_api_key_launcher_line_is_the_one_its_test_starts() -> None:
    (serve,) = sh_commands(section(DOC.read_text(), "## API key"), "colocate_runtime.sglang.serve")
    assert serve[:3] == ["python", "-m", "colocate_runtime.sglang.serve"]
    assert importlib.util.find_spec("colocate_runtime.sglang.serve") is not None
    assert '["-m", "colocate_runtime.sglang.serve"]' in SERVE_TEST.read_text()
    assert flags(serve) <= flags(job_command())
