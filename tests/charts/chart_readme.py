"""Generate charts/weightroll/README.md from README.md.gotmpl and the `# --` values comments.

A small stand-in for helm-docs (not installable here), using the same template names so helm-docs
can take over: ``chart.name``, ``chart.description``, ``chart.version``, ``chart.appVersion``,
``chart.valuesTable``. ``# @default -- text`` overrides the default shown for a key.

Usage: ``python tests/charts/chart_readme.py --write`` (``--check`` exits 1 on drift; the chart
tests call :func:`generate` and compare).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "weightroll"
KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z][\w.-]*):")


def _comments(lines: list[str], i: int) -> tuple[str, str | None]:
    """The `# --` description above line ``i`` and an optional `# @default --` override."""
    block: list[str] = []
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("#"):
        block.insert(0, lines[j].strip()[1:].strip())
        j -= 1
    desc: list[str] = []
    default = None
    in_desc = False
    for text in block:
        if text.startswith("-- "):
            in_desc, desc = True, [text[3:]]
        elif text.startswith("@default -- "):
            default, in_desc = text[len("@default -- ") :], False
        elif in_desc:
            desc.append(text)
    return " ".join(desc), default


def _type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def values_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf of values.yaml, in file order."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(lines))
    stack: list[tuple[int, str]] = []
    rows = []
    for i, line in enumerate(lines):
        m = KEY.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [m["key"]]
        stack.append((indent, m["key"]))
        value: Any = values
        for k in path:
            value = value[k]
        if isinstance(value, dict) and value:
            continue
        desc, default = _comments(lines, i)
        shown = f"`{json.dumps(value)}`" if default is None else default
        rows.append((".".join(path), _type(value), shown, desc))
    return rows


def generate() -> str:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    table = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    table += [f"| {k} | {t} | {d} | {desc} |" for k, t, d, desc in values_rows()]
    text = (CHART / "README.md.gotmpl").read_text()
    subs = {
        "chart.name": meta["name"],
        "chart.description": " ".join(meta["description"].split()),
        "chart.version": meta["version"],
        "chart.appVersion": meta["appVersion"],
        "chart.valuesTable": "\n".join(table),
    }
    for name, value in subs.items():
        text = text.replace('{{ template "' + name + '" . }}', value)
    return text


def main(argv: list[str]) -> int:
    readme = CHART / "README.md"
    text = generate()
    if "--write" in argv:
        readme.write_text(text)
        return 0
    if readme.read_text() != text:
        print(f"{readme} is out of date: run python tests/charts/chart_readme.py --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
