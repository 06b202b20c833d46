"""The vLLM contact surface (engine_agent/vllm_surface.py) is complete, checked and documented.

* every ``from vllm... import`` in engine_agent and every vLLM route the sidecar or the trainer
  client calls is a listed contact, so the list cannot silently fall behind the code;
* the installed vLLM (the release the engine tier runs) has every required contact;
* the static checker finds a missing name, member and route in a source tree;
* docs/vllm-surface.md (generated from the 0.33 and 0.34 wheels, which cannot run here) lists
  exactly today's contacts, with every required one present in every release it names;
* the run-time range check (``check_vllm_version``) reads PEP 440 versions with ``packaging``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from weightroll_dev.vllm_surface import SourceTree, check, markdown

from engine_agent import vllm_extension, vllm_surface
from engine_agent.reload.registry import check_vllm_version
from engine_agent.vllm_surface import CONTACTS, Contact

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "engine_agent"
DOC = ROOT / "docs" / "vllm-surface.md"


def _vllm_imports() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found |= {(str(node.module), alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"}
    return found


def test_every_vllm_import_is_a_listed_contact() -> None:
    names = {(c.module, c.name) for c in CONTACTS if c.kind == "name"}
    modules = {c.module for c in CONTACTS}
    unlisted = [
        f"{module}:{name}"
        for module, name in sorted(_vllm_imports())
        if (module, name) not in names
        and f"{module}.{name}" not in modules
        and not (name == "" and module in modules)
    ]
    assert unlisted == [], "add these to engine_agent/vllm_surface.py CONTACTS"


def test_every_vllm_route_called_is_a_listed_contact() -> None:
    routes = {c.name for c in CONTACTS if c.kind == "route"}
    called: set[str] = set()
    # Every sidecar file and the trainer client: a call moved to a new module is still seen.
    for file in [*sorted((PACKAGE / "sidecar").rglob("*.py")), PACKAGE / "trainer.py"]:
        called |= set(re.findall(r'"(/[a-z_]+)"', file.read_text()))
    agent_own = {"/healthz", "/readyz", "/metrics"}  # the sidecar's own routes
    assert called - routes - agent_own == set()


def test_the_installed_vllm_has_every_required_contact() -> None:
    pytest.importorskip("vllm")
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    tree = SourceTree.from_directory(Path(spec.origin).parents[1])
    missing = [f"{c.module}:{c.name}" for c in check(tree) if not c.optional]
    assert missing == []


def test_the_checker_finds_what_is_missing(tmp_path: Path) -> None:
    pkg = tmp_path / "vllm" / "mod"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "_version.py").write_text('__version__ = version = "9.9.9"\n')
    (pkg / "__init__.py").write_text(
        "from os import path as joined\n"
        "class Worker:\n"
        "    kept = 1\n"
        "    def __init__(self):\n"
        "        self.model_runner = None\n"
        "def there(): pass\n"
        "router.post('/pause')\n"
    )
    tree = SourceTree.from_directory(tmp_path)
    assert tree.label == "9.9.9"
    contacts = [
        Contact("vllm.mod", "there", "x"),
        Contact("vllm.mod", "joined", "x"),
        Contact("vllm.mod", "Worker.model_runner", "x", "member"),
        Contact("vllm.mod", "Worker.kept", "x", "member"),
        Contact("vllm", "/pause", "x", "route"),
        Contact("vllm.mod", "gone", "x"),
        Contact("vllm.mod", "Worker.gone", "x", "member"),
        Contact("vllm", "/resume", "x", "route"),
        Contact("vllm.absent", "there", "x"),
    ]
    assert [c.name for c in check(tree, contacts)] == [
        "gone",
        "Worker.gone",
        "/resume",
        "there",
    ]


def test_the_support_table_is_current() -> None:
    text = DOC.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| Contact |"))
    releases = [c.strip() for c in header.strip("|").split("|")[3:]]
    assert {"0.33.0", "0.34.0"} <= set(releases), "regenerate with make vllm-surface"
    # What the table would say if every contact it shows as missing is missing again: the
    # same text means the table lists exactly today's contacts, in order, with today's words.
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    missing: dict[str, list[Contact]] = {r: [] for r in releases}
    for contact, row in zip(CONTACTS, rows, strict=True):
        marks = [m.strip() for m in row.strip("|").split("|")[3:]]
        for release, mark in zip(releases, marks, strict=True):
            if mark != "✓":
                missing[release].append(contact)
                assert contact.optional, f"{contact.name} missing in {release}"
    assert markdown(missing) == text, "regenerate docs/vllm-surface.md with make vllm-surface"


def test_one_supported_range() -> None:
    assert vllm_extension.SUPPORTED_VLLM == vllm_surface.SUPPORTED_VLLM


@pytest.mark.parametrize(
    "version",
    ["0.32.0", "0.32.0+cpu", "0.33.0rc1", "0.34.1.dev5+g1234abc", "0.34.9", "0.32"],
)
def test_a_release_of_a_supported_minor_is_accepted(version: str) -> None:
    assert vllm_surface.SUPPORTED_VLLM == ((0, 32), (0, 35)), "update the versions of this table"
    check_vllm_version(version)


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("0.31.9", "found 0.31.9"),
        ("0.35.0", "found 0.35.0"),
        ("0.35.0rc1", "found 0.35.0rc1"),  # a candidate of the first unsupported minor
        ("1.0.0", "found 1.0.0"),
        ("0.4.0", "found 0.4.0"),  # 4 < 32 as a number, not as text
        ("0.320.0", "found 0.320.0"),
        ("not-a-version", "not a PEP 440 version"),
        ("", "not a PEP 440 version"),
    ],
)
def test_a_version_outside_the_range_is_refused(version: str, said: str) -> None:
    with pytest.raises(RuntimeError) as refused:
        check_vllm_version(version)
    assert str(refused.value).startswith("weightroll supports vLLM 0.32 to <0.35, found ")
    assert said in str(refused.value)


def test_vllms_incomplete_flag_follows_the_rank_state() -> None:
    from types import SimpleNamespace

    from engine_agent.vllm_extension import INCOMPLETE_MARK, sync_incomplete_flag

    worker = SimpleNamespace(_incomplete_weight_updates=set())
    sync_incomplete_flag(worker, serving_safe=False)  # open, dirty or poisoned
    assert worker._incomplete_weight_updates == {INCOMPLETE_MARK}
    worker._incomplete_weight_updates.add(False)  # vLLM's own update in flight
    sync_incomplete_flag(worker, serving_safe=True)
    assert worker._incomplete_weight_updates == {False}, "only our own entry is cleared"
    older = SimpleNamespace()  # vLLM < 0.34: no flag, nothing set
    sync_incomplete_flag(older, serving_safe=False)
    assert not hasattr(older, "_incomplete_weight_updates")
