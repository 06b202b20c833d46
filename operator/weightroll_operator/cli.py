"""The ``weightroll`` command: the one composition root of the project.

Each subcommand imports its implementation lazily, so ``weightroll operator`` never imports the
sidecar and ``weightroll agent`` never imports kopf. Subcommand modules expose
``main(argv: list[str]) -> int`` and own their ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
    "demo": (
        "engine_agent.demo",
        "run a verified in-place update on a real vLLM engine on this machine (make demo); "
        "--cluster: a rollout through three vLLM pods on a local cluster (make demo-cluster)",
    ),
}
#: ``weightroll demo --cluster`` (the operator side; ``engine_agent.demo`` never imports it).
CLUSTER_DEMO = "weightroll_operator.demo_cluster"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightroll",
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
    if command == "demo" and "--cluster" in rest:
        target, rest = CLUSTER_DEMO, [a for a in rest if a != "--cluster"]
    module = importlib.import_module(target)
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
