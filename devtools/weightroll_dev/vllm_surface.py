"""Check weightroll's contact surface with vLLM against vLLM *sources*, statically (issue 26 F).

Usage (checkout only)::

    python -m weightroll_dev.vllm_surface vllm-0.33.0-*.whl vllm-0.34.0-*.whl [--installed]
        [--markdown docs/vllm-surface.md]

Each argument is a wheel (read as a zip, nothing installed or imported) or a directory holding a
``vllm/`` source tree; ``--installed`` adds the vLLM installed in this environment. For every
contact of :data:`engine_agent.vllm_surface.CONTACTS` it parses the module's source with
:mod:`ast` and says whether the name is there (see that module for the three kinds). Prints one
JSON object (release -> missing contacts); ``--markdown`` also writes the support table. Exit
status 1 when a required contact is missing in any release given.

Static, so it cannot tell a changed *meaning* from an unchanged name: it answers "does our code
still find what it calls", which is what breaks first; behaviour is what the engine tier tests on
the release it runs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine_agent.vllm_surface import CONTACTS, SUPPORTED_VLLM, TESTED_VLLM, Contact

__all__ = ["SourceTree", "check", "main", "markdown"]

_VERSION = re.compile(r"""^__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", re.M)
_FALLBACK_VERSION = re.compile(r"""^(?:__version__|version)\s*=\s*['"]([^'"]+)['"]""", re.M)


@dataclass
class SourceTree:
    """One vLLM release's Python sources: ``read(relative path) -> text or None``."""

    label: str
    read: Callable[[str], str | None]
    paths: Callable[[], Iterable[str]]
    #: package prefix -> the texts of every module under it (routes are searched many times).
    _texts: dict[str, list[str]] = field(default_factory=dict)

    def texts_under(self, prefix: str) -> list[str]:
        if prefix not in self._texts:
            self._texts[prefix] = [
                self.read(rel) or ""
                for rel in self.paths()
                if rel.startswith(prefix) and rel.endswith(".py")
            ]
        return self._texts[prefix]

    @staticmethod
    def from_wheel(path: Path) -> SourceTree:
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())

        def read(rel: str) -> str | None:
            return archive.read(rel).decode() if rel in names else None

        return SourceTree(_label(read, path.name), read, lambda: sorted(names))

    @staticmethod
    def from_directory(root: Path) -> SourceTree:
        def read(rel: str) -> str | None:
            file = root / rel
            return file.read_text() if file.is_file() else None

        def paths() -> list[str]:
            return sorted(str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py"))

        return SourceTree(_label(read, str(root)), read, paths)


def _label(read: Callable[[str], str | None], fallback: str) -> str:
    text = read("vllm/_version.py") or ""
    found = _VERSION.search(text) or _FALLBACK_VERSION.search(text)
    return found.group(1) if found else fallback


def _module_source(tree: SourceTree, module: str) -> str | None:
    base = module.replace(".", "/")
    return tree.read(f"{base}.py") or tree.read(f"{base}/__init__.py")


def _bound_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions (TYPE_CHECKING, try)
            inner = list(node.body) + list(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            names |= _bound_names(inner)
    return names


def _member(module_tree: ast.Module, class_name: str, attr: str) -> bool:
    for node in ast.walk(module_tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if attr in _bound_names(node.body):
                return True
            for item in ast.walk(node):
                if (
                    isinstance(item, ast.Attribute)
                    and isinstance(item.ctx, ast.Store)
                    and isinstance(item.value, ast.Name)
                    and item.value.id == "self"
                    and item.attr == attr
                ):
                    return True
    return False


def _route(tree: SourceTree, package: str, path: str) -> bool:
    prefix = package.replace(".", "/") + "/"
    registered = r"""(?:\.(?:get|post|put|api_route|add_api_route)|\bMount)\(\s*['"]"""
    literal = re.compile(registered + re.escape(path) + r"""['"]""")
    return any(literal.search(text) for text in tree.texts_under(prefix))


def present(tree: SourceTree, contact: Contact) -> bool:
    """Whether ``contact`` is found in ``tree``'s sources."""
    if contact.kind == "route":
        return _route(tree, contact.module, contact.name)
    source = _module_source(tree, contact.module)
    if source is None:
        return False
    parsed = ast.parse(source)
    if contact.kind == "member":
        class_name, _, attr = contact.name.partition(".")
        return _member(parsed, class_name, attr)
    return contact.name in _bound_names(parsed.body)


def check(tree: SourceTree, contacts: Iterable[Contact] = CONTACTS) -> list[Contact]:
    """The contacts missing from ``tree`` (required and optional)."""
    return [c for c in contacts if not present(tree, c)]


def _key(contact: Contact) -> str:
    where = contact.module if contact.kind == "route" else f"{contact.module}"
    return f"{where}:{contact.name}"


def markdown(results: dict[str, list[Contact]]) -> str:
    """The support table of docs/vllm-surface.md."""
    releases = list(results)
    low, high = SUPPORTED_VLLM
    lines = [
        "# vLLM contact surface",
        "",
        "Generated by `make vllm-surface` (`python -m weightroll_dev.vllm_surface`) from the",
        "releases' sources; do not edit. Every place weightroll touches vLLM is listed in",
        "`engine_agent/vllm_surface.py`; ✓ = found in that release's sources, ✗ = missing,",
        "(✗) = missing but optional (feature-detected at run time).",
        "",
        f"Accepted at run time: vLLM {low[0]}.{low[1]} to <{high[0]}.{high[1]}. Tested (engine",
        f"tier, CPU): {TESTED_VLLM}. Checked statically: {', '.join(releases)}.",
        "",
        "| Contact | Kind | Why | " + " | ".join(releases) + " |",
        "|---|---|---|" + "---|" * len(releases),
    ]
    for contact in CONTACTS:
        marks = []
        for release in releases:
            missing = contact in results[release]
            marks.append(("(✗)" if contact.optional else "✗") if missing else "✓")
        lines.append(
            f"| `{_key(contact)}` | {contact.kind} | {contact.use} | " + " | ".join(marks) + " |"
        )
    return "\n".join(lines) + "\n"


def _installed() -> SourceTree:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("--installed: vLLM is not installed in this environment")
    return SourceTree.from_directory(Path(spec.origin).parents[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("sources", nargs="*", type=Path, help="vLLM wheels or source roots")
    parser.add_argument("--installed", action="store_true", help="also the installed vLLM")
    parser.add_argument("--markdown", type=Path, help="write the support table here")
    args = parser.parse_args(argv)
    trees = [_installed()] if args.installed else []
    trees += [
        SourceTree.from_wheel(p) if p.suffix == ".whl" else SourceTree.from_directory(p)
        for p in args.sources
    ]
    if not trees:
        parser.error("give at least one wheel or source root, or --installed")
    results = {tree.label: check(tree) for tree in trees}
    print(json.dumps({label: [_key(c) for c in missing] for label, missing in results.items()}))
    if args.markdown:
        args.markdown.write_text(markdown(results))
    required_missing = any(not c.optional for missing in results.values() for c in missing)
    return 1 if required_missing else 0


if __name__ == "__main__":
    sys.exit(main())
