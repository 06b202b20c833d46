"""The ``weightroll`` command: the one composition root of the project.

Each subcommand imports its implementation lazily, so ``weightroll operator`` never imports the
sidecar and ``weightroll agent`` never imports kopf. Subcommand modules expose
``main(argv: list[str]) -> int`` and own their ``--help``; the day-2 verbs ``pause``, ``resume``
and ``promote`` share one module, whose ``main`` gets the verb as its first argument.

``weightroll demo`` and ``weightroll dev`` are development tools of a checkout: their code is in
``devtools/weightroll_dev``, outside the package. From a checkout the CLI puts ``devtools/`` on
``sys.path`` for them; an installed wheel neither lists them nor runs them (it says why).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

#: ``weightroll pause|resume|promote``: one module; its ``main`` gets the verb first.
CONTROL = "weightroll_operator.control"
#: subcommand -> (module exposing ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "operator": (
        "weightroll_operator.main",
        "run the WeightUpdate operator (kopf) against the current kubeconfig or in-cluster",
    ),
    "agent": (
        "engine_agent.sidecar.main",
        "run the pod sidecar that drives one vLLM replica (needs --token-file)",
    ),
    "manifest": (
        "engine_agent.manifest",
        "write a JSON manifest (sha256 per tensor) for a checkpoint",
    ),
    "status": (
        "weightroll_operator.status_view",
        "show a WeightUpdate NAME: phase, pods, conditions, events",
    ),
    "pause": (
        CONTROL,
        "pause a WeightUpdate NAME: units in flight finish, no new unit starts (spec.paused)",
    ),
    "resume": (
        CONTROL,
        "resume a paused WeightUpdate NAME: new units start again",
    ),
    "promote": (
        CONTROL,
        "promote a WeightUpdate NAME held after its canary (spec.strategy.pauseAfterCanary)",
    ),
}
#: Commands of a checkout only: their modules live in ``devtools/weightroll_dev``, which neither
#: the wheel nor the images contain. Listed in ``--help`` only where ``devtools/`` is found.
DEV_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "weightroll_dev.demo_cluster",
        "roll a verified update through three vLLM pods on a local cluster (make demo); "
        "--engine: the failure modes on one vLLM engine, no cluster (make demo-engine)",
    ),
}
#: ``weightroll demo --engine``: the single-engine demo (it imports vLLM).
ENGINE_DEMO = "weightroll_dev.demo_engine"
#: Said when a checkout-only command runs from an installed package.
NEEDS_CHECKOUT = (
    "weightroll {command}: this command needs a checkout of the weightroll repository (its code "
    "is in devtools/, which the package does not install); run it from a clone, e.g. `make demo`"
)


def devtools_dir() -> Path | None:
    """``devtools/`` of the checkout this module runs from, or None (an installed wheel).

    The CLI lives at ``<checkout>/operator/weightroll_operator/cli.py``; an installed copy has no
    ``devtools/weightroll_dev`` two levels up.
    """
    found = Path(__file__).resolve().parents[2] / "devtools"
    return found if (found / "weightroll_dev" / "__init__.py").is_file() else None


def _commands() -> dict[str, tuple[str, str]]:
    return {**SUBCOMMANDS, **DEV_COMMANDS} if devtools_dir() is not None else dict(SUBCOMMANDS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightroll",
        description="Roll verified in-place weight updates through vLLM servers.",
        epilog="Run `weightroll COMMAND --help` for the options of one command. "
        "Docs: README.md, docs/architecture.md, docs/api.md.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _commands().items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    command, rest = args[0], args[1:]
    commands = _commands()
    if command in DEV_COMMANDS and command not in commands:
        print(NEEDS_CHECKOUT.format(command=command), file=sys.stderr)
        return 2
    if command not in commands:
        parser.print_usage(sys.stderr)
        print(
            f"weightroll: unknown command {command!r}; choose one of {', '.join(commands)}",
            file=sys.stderr,
        )
        return 2
    target = commands[command][0]
    if command in DEV_COMMANDS:
        devtools = str(devtools_dir())
        if devtools not in sys.path:
            sys.path.insert(0, devtools)
    if command == "demo":
        if "--engine" in rest:
            target = ENGINE_DEMO
        # `--cluster` is the default (kept so earlier command lines still work).
        rest = [a for a in rest if a not in ("--engine", "--cluster")]
    if target == CONTROL:
        rest = [command, *rest]
    module = importlib.import_module(target)
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
