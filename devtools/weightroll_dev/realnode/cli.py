"""``python -m weightroll_dev node up|down``: the real node, left running in the background.

``up`` returns once the node is Ready and prints how to reach it (every client runs inside the
node's network namespace: ``nsenter --net=/run/netns/NAME kubectl ...``); ``down`` takes all of
it back and reports anything it could not undo (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from weightroll_dev.devcluster.apiserver import REPO
from weightroll_dev.realnode.node import NodeError, down, up

__all__ = ["DEFAULT_DIR", "main"]

DEFAULT_DIR = REPO / ".cache" / "realnode"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m weightroll_dev node",
        description="A real one-node Kubernetes 1.20 (etcd, kube-apiserver, controller-manager, "
        "scheduler, containerd, kubelet) inside a network namespace of its own; needs root.",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = sub.add_parser("up", help="start the node; returns when it is Ready")
    start.add_argument("--timeout", type=float, default=180, help="seconds (default 180)")
    stop = sub.add_parser("down", help="stop everything `node up` started in --dir")
    for action in (start, stop):
        action.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_DIR,
            help=f"the node's directory (default {DEFAULT_DIR.relative_to(REPO)})",
        )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.action == "down":
        problems = down(args.dir)
        for problem in problems:
            print(f"weightroll_dev node down: left behind: {problem}", file=sys.stderr)
        if not problems:
            print(f"real node in {args.dir.resolve()} stopped", flush=True)
        return 1 if problems else 0
    try:
        node = up(args.dir, say=lambda line: print(line, flush=True), timeout=args.timeout)
    except NodeError as e:
        print(f"weightroll_dev node up: {e}", file=sys.stderr)
        return 1
    print(
        f"\nReal node {node.node_name} Ready in {node.startup_seconds:.1f} s\n"
        f"  {' '.join(node.in_netns('kubectl', f'--kubeconfig={node.kubeconfig}'))} get nodes\n"
        f"  stop it: python -m weightroll_dev node down --dir {args.dir}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
