"""Writes the `COLOCATE_*` tables of operator/README.md from the contract table (contract/env.py),
between its `<!-- BEGIN pod-env ... -->` / `operator-env` marker comments; tests/operator/test_env_contract.py
fails when the README and the table differ. A development tool: nothing deployed imports it.

    python tools/env_readme.py --write operator/README.md
    python tools/env_readme.py                             # print the tables
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

from colocate_runtime.contract.env import OPERATOR_SETTINGS, POD, EnvError, Var


def markdown(variables: Iterable[Var], *, with_source: bool) -> str:
    """A Markdown table of `variables` (operator/README.md holds these between marker comments)."""
    head = ["variable", "type", "default", "read by", "meaning"] + (["set from"] if with_source else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for var in variables:
        kind = "secret" if var.secret else var.kind.__name__
        if var.choices:
            kind = " \\| ".join(f"`{c}`" for c in var.choices)
        default = var.default_text()
        if var.operator_default is not None:
            default += f" (operator: `{var.operator_default}`)"
        row = [f"`{var.name}`", kind, default, var.read_by, var.meaning]
        if with_source:
            row.append(var.source or "not injected")
        lines.append("| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |")
    return "\n".join(lines)


BLOCKS = {
    "pod-env": lambda: markdown(POD, with_source=True),
    "operator-env": lambda: markdown(OPERATOR_SETTINGS, with_source=False),
}


def _block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {name}: generated[^\n]*-->\n)(.*?)(\n<!-- END {name} -->)", re.S)


def readme_blocks(text: str) -> dict[str, str]:
    """The generated blocks as a README holds them (a missing block is missing from the result)."""
    found = {}
    for name in BLOCKS:
        match = _block_pattern(name).search(text)
        if match:
            found[name] = match.group(2)
    return found


def rewrite(text: str) -> str:
    for name, render in BLOCKS.items():
        pattern = _block_pattern(name)
        if not pattern.search(text):
            raise EnvError(f"no '<!-- BEGIN {name}: generated ... -->' block in the README")
        text = pattern.sub(lambda m, r=render: m.group(1) + r() + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the COLOCATE_* tables into operator/README.md.")
    parser.add_argument("--write", type=Path, metavar="README", help="rewrite its generated blocks in place")
    args = parser.parse_args(argv)
    if args.write is None:
        for render in BLOCKS.values():
            print(render(), end="\n\n")
        return
    args.write.write_text(rewrite(args.write.read_text()))


if __name__ == "__main__":
    main()
