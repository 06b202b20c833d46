"""``python -m weightroll_dev demo|dev ...``: the checkout's development commands.

They left the product's ``weightroll`` command (which has the user's verbs only) because their
code lives here, outside the wheel; ``make demo`` and ``make demo-engine`` run them with
``devtools/`` on ``PYTHONPATH``.

* ``demo [--scenario ok|fail] [--on-failure Halt|Rollback]``: the cluster demo (``make demo``);
  ``demo --engine``: the single-engine demo (``make demo-engine``);
* ``dev up|down [--dir DIR] ...``: a local dev cluster left running in the background;
* ``node up|down [--dir DIR]``: a real one-node Kubernetes (kubelet, containerd) in a network
  namespace (root; :mod:`weightroll_dev.realnode`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: command -> (module exposing ``main(argv) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "weightroll_dev.demo_cluster",
        "roll a verified update through three vLLM pods on a local cluster (make demo); "
        "--engine: the failure modes on one vLLM engine, no cluster (make demo-engine)",
    ),
    "dev": (
        "weightroll_dev.devcluster.dev",
        "dev up|down: a local cluster (kube-apiserver, chart, operator, N vLLM pods) left "
        "running in the background, described in DIR/cluster.json",
    ),
    "node": (
        "weightroll_dev.realnode.cli",
        "node up|down: a real one-node Kubernetes (kubelet, containerd, controllers) inside a "
        "network namespace; needs root and the built node binaries",
    ),
}
#: ``demo --engine``: the single-engine demo (it imports vLLM).
ENGINE_DEMO = "weightroll_dev.demo_engine"
PROG = "python -m weightroll_dev"


def usage() -> str:
    lines = [f"usage: {PROG} COMMAND ...", "", "commands:"]
    lines += [f"  {name:6} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        known = ", ".join(COMMANDS)
        print(f"{PROG}: unknown command {command!r}; choose one of {known}", file=sys.stderr)
        return 2
    target = COMMANDS[command][0]
    if command == "demo":
        if "--engine" in rest:
            target = ENGINE_DEMO
        # `--cluster` is the default (kept so earlier command lines still work).
        rest = [a for a in rest if a not in ("--engine", "--cluster")]
    result: int = importlib.import_module(target).main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
