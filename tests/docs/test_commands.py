"""Every shell command in the README and the docs is valid as written.

Commands come from fenced ``bash``/``sh``/``shell`` blocks (every line) and ``console`` blocks
(lines starting with ``$``) of README.md, docs/**/*.md and examples/*/README.md. Each one is
checked as far as it can be without a cluster:

* the whole block parses with ``bash -n`` (``<placeholder>`` words are substituted first);
* ``make TARGET``: the target exists in the Makefile;
* ``weightroll SUBCOMMAND ...``: the subcommand exists, every flag appears in its ``--help``,
  and the arguments parse with the subcommand's own parser;
* ``python -m MODULE`` of this project: the module is importable; ``python FILE``: it exists;
* every argument that is a path inside this repository (its first segment is a top-level entry,
  e.g. ``examples/...``, ``charts/...``) exists;
* commands that need a cluster or a registry (``kubectl``, ``helm``, ``docker``, ``curl`` ...)
  get only the checks above.

Relative Markdown links of the same files must point at files that exist.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from weightroll_operator import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "examples").glob("*/README.md"),
        ROOT / "examples" / "README.md",
    }
)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_PLACEHOLDER = re.compile(r"<([A-Za-z][\w-]*)>")
_SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")"}
#: Modules whose ``main`` parses a subcommand's arguments (``demo`` builds its parser inline).
#: A module serving several subcommands (its ``VERBS``) builds the parser of one: ``_parser(sub)``.
_PARSERS = {
    "manifest": "engine_agent.manifest.cli",
    "lint": "weightroll_operator.lint",
    "status": "weightroll_operator.status_view",
    "pause": "weightroll_operator.control",
    "resume": "weightroll_operator.control",
    "promote": "weightroll_operator.control",
}
#: The daemons' own commands (console scripts) -> the module whose ``_parser()`` they run.
_DAEMONS = {
    "weightroll-operator": "weightroll_operator.main",
    "weightroll-agent": "engine_agent.sidecar.main",
}
_OWN_PACKAGES = ("weightroll_operator", "engine_agent", "weightroll_dev", "tests", "bench")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def shell_blocks(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line, language, body)`` of every shell block of a Markdown file."""
    text = path.read_text()
    for match in _FENCE.finditer(text):
        if match.group(1) in SHELL_LANGS:
            yield text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)


def commands(language: str, body: str) -> list[str]:
    """The commands of one block, backslash continuations joined, placeholders substituted."""
    result: list[str] = []
    pending: list[str] = []
    for raw in body.splitlines():
        line = raw
        if not pending and language == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line.strip().removesuffix("\\").rstrip())
        if not line.rstrip().endswith("\\"):
            result.append(_PLACEHOLDER.sub(_placeholder, " ".join(pending)))
            pending = []
    if pending:
        result.append(" ".join(pending))
    return result


def _placeholder(match: re.Match[str]) -> str:
    """``<name>`` as a value any argument accepts, a Kubernetes name included."""
    return "placeholder-" + match.group(1).lower().replace("_", "-")


def simple_commands(command: str) -> list[list[str]]:
    """Split a command line into its simple commands (pipelines, lists), as argv lists."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in _SEPARATORS:
            out.append([])
        else:
            out[-1].append(token)
    # Leading VAR=value assignments are not the program.
    argvs = []
    for argv in out:
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            argv = argv[1:]
        if argv:
            argvs.append(argv)
    return argvs


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+):", text, re.M))


@functools.cache
def subcommand_help(*names: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*names, "--help"])
    return out.getvalue()


@functools.cache
def top_level() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.iterdir() if not p.name.startswith("."))


def check_paths(argv: list[str]) -> list[str]:
    problems = []
    for token in argv:
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if "placeholder-" in value or value.startswith(("/", "-", "$")) or "://" in value:
            continue
        first = value.split("/", 1)[0]
        if "/" in value and first in top_level() and not (ROOT / value).exists():
            problems.append(f"{value}: no such file in the repository")
    return problems


def check_flags(label: str, help_text: str, rest: list[str], parser: Any = None) -> list[str]:
    """Every flag of ``rest`` is in ``help_text``; then ``rest`` parses with ``parser``."""
    problems = []
    for token in rest:
        if token.startswith("-") and token != "-":
            flag = token.split("=", 1)[0]
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                problems.append(f"{label}: no option {flag}")
    if parser is not None and not problems:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(rest)
        except SystemExit as e:
            if e.code:
                problems.append(f"{label}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


def check_weightroll(argv: list[str]) -> list[str]:
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "--version"):
        return []
    sub, rest = args[0], args[1:]
    if sub not in cli.SUBCOMMANDS:
        return [f"weightroll {sub}: no such subcommand"]
    parser = None
    if sub in _PARSERS:
        module = importlib.import_module(_PARSERS[sub])
        parser = module._parser(sub) if sub in getattr(module, "VERBS", ()) else module._parser()
    return check_flags(f"weightroll {sub}", subcommand_help(sub), rest, parser)


def check_daemon(argv: list[str]) -> list[str]:
    parser = importlib.import_module(_DAEMONS[Path(argv[0]).name])._parser()
    return check_flags(Path(argv[0]).name, parser.format_help(), argv[1:], parser)


def check_dev(args: list[str]) -> list[str]:
    """``python -m weightroll_dev demo|dev ...``: the command exists, its flags too."""
    from weightroll_dev.__main__ import COMMANDS, ENGINE_DEMO

    if not args or args[0] in ("-h", "--help"):
        return []
    if args[0] not in COMMANDS:
        return [f"python -m weightroll_dev {args[0]}: no such command"]
    target = ENGINE_DEMO if "--engine" in args else COMMANDS[args[0]][0]
    rest = [a for a in args[1:] if a != "--engine"]
    module = importlib.import_module(target)
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        module.main(["--help"])
    if rest and not rest[0].startswith("-") and args[0] == "dev":  # `dev up|down` own options
        with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
            module.main([rest[0], "--help"])
    return check_flags(f"python -m weightroll_dev {args[0]}", help_text.getvalue(), rest)


def check_python(argv: list[str]) -> list[str]:
    args = argv[1:]
    if len(args) >= 2 and args[0] == "-m":
        module = args[1]
        if module.split(".")[0] in _OWN_PACKAGES and importlib.util.find_spec(module) is None:
            return [f"python -m {module}: no such module"]
        if module == "weightroll_dev":
            return check_dev(args[2:])
        return []
    if args and not args[0].startswith("-") and not (ROOT / args[0]).is_file():
        return [f"python {args[0]}: no such file"]
    return []


def check_command(command: str) -> list[str]:
    problems: list[str] = []
    for argv in simple_commands(command):
        program = Path(argv[0]).name
        problems += check_paths(argv)
        if program == "make":
            problems += [
                f"make {t}: no such target"
                for t in argv[1:]
                if not t.startswith("-") and "=" not in t and t not in make_targets()
            ]
        elif program in ("weightroll", "kubectl-weightroll"):
            problems += check_weightroll(argv)
        elif program in _DAEMONS:
            problems += check_daemon(argv)
        elif re.fullmatch(r"python3?(\.\d+)?", program):
            problems += check_python(argv)
    return problems


CASES = [
    pytest.param(path, line, language, body, id=f"{_rel(path)}:{line}")
    for path in DOCS
    for line, language, body in shell_blocks(path)
]


def test_docs_have_commands() -> None:
    by_file = {_rel(p.values[0]) for p in CASES}  # type: ignore[index]
    assert {"README.md", "docs/api.md", "examples/01-basic/README.md"} <= by_file


@pytest.mark.parametrize(("path", "line", "language", "body"), CASES)
def test_block_commands_are_valid(path: Path, line: int, language: str, body: str) -> None:
    cmds = commands(language, body)
    assert cmds, f"{_rel(path)}:{line}: a {language} block without a command"
    script = "\n".join(cmds) + "\n"
    done = subprocess.run(
        ["bash", "-n"], input=script, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, f"{_rel(path)}:{line}: bash -n: {done.stderr}"
    problems = [f"{cmd!r}: {p}" for cmd in cmds for p in check_command(cmd)]
    assert problems == [], f"{_rel(path)}:{line}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path: Path) -> None:
    text = _FENCE.sub("", path.read_text())
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert broken == [], f"{_rel(path)}: broken links"


# The checker itself: it must catch what it claims to catch.


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("make tset", "make tset: no such target"),
        ("weightroll stauts llama", "weightroll stauts: no such subcommand"),
        ("weightroll status llama --namespce ml", "weightroll status: no option --namespce"),
        ("weightroll status", "weightroll status: "),
        ("kubectl apply -f examples/99-nope/weightupdate.yaml", "examples/99-nope"),
        ("python -m weightroll_operator.nope", "no such module"),
        ("FOO=1 weightroll manifest", "weightroll manifest: "),
        ("weightroll pause llama --force", "weightroll pause: no option --force"),
        ("weightroll promote", "weightroll promote: "),
    ],
)
def test_checker_catches(command: str, expected: str) -> None:
    problems = check_command(command)
    assert any(expected in p for p in problems), problems


def test_checker_accepts() -> None:
    ok = [
        "make demo && make test",
        "weightroll status llama-v2 -n ml",
        "weightroll promote llama-v2 -n ml --force",
        "weightroll manifest /models/v2 --version v2 --out=/tmp/m.json",
        "kubectl apply -n ml -f examples/01-basic/weightupdate.yaml | cat",
        "python -m weightroll_operator.api.crdgen --check",
    ]
    assert {c: check_command(c) for c in ok} == {c: [] for c in ok}
    assert commands("console", "$ weightroll status x \\\n   -n y\nNAME  PHASE\n") == [
        "weightroll status x -n y"
    ]
