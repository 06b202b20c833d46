"""The ``weightroll`` command: the one composition root of the project.

Each subcommand imports its implementation lazily, so ``weightroll operator`` never imports the
sidecar and ``weightroll agent`` never imports kopf. Subcommand modules expose
``main(argv: list[str]) -> int`` and own their ``--help``; the day-2 verbs ``pause``, ``resume``
and ``promote`` share one module, whose ``main`` gets the verb as its first argument.

The same ``main`` is installed twice (``pyproject.toml``): as ``weightroll`` and as
``kubectl-weightroll``, which kubectl runs for ``kubectl weightroll ...`` (kubectl's plugin
mechanism: an executable named ``kubectl-<name>`` on ``PATH``).
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
        "show a WeightUpdate NAME (phase, pods, conditions, events; -o json|yaml); exit 0 "
        "Succeeded, 3 Failed, 4 not finished; --watch waits for the end",
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
    "demo": (
        "weightroll_operator.demo_cluster",
        "roll a verified update through three vLLM pods on a local cluster (make demo); "
        "--engine: the failure modes on one vLLM engine, no cluster (make demo-engine)",
    ),
}
#: ``weightroll demo --engine``: the single-engine demo (the agent side; it imports vLLM).
ENGINE_DEMO = "engine_agent.demo"


#: The console script kubectl runs as its ``weightroll`` plugin.
KUBECTL_PLUGIN = "kubectl-weightroll"


def _prog() -> str:
    """``kubectl weightroll`` when run as the kubectl plugin, else ``weightroll``."""
    return "kubectl weightroll" if Path(sys.argv[0]).name == KUBECTL_PLUGIN else "weightroll"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Roll verified in-place weight updates through vLLM servers.",
        epilog="Run `weightroll COMMAND --help` for the options of one command. "
        "Docs: README.md, docs/architecture.md, docs/api.md.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        parser.print_usage(sys.stderr)
        print(
            f"weightroll: unknown command {command!r}; choose one of {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    target = SUBCOMMANDS[command][0]
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
