"""``weightroll_dev dev up`` / ``weightroll_dev dev down``: a local dev cluster from a checkout.

``up`` starts the one bring-up of :mod:`.bringup` (shared by ``make demo`` and the e2e tier) in
the background and returns when the pods are Ready, printing how to reach it; ``down`` stops
everything it started. Both take ``--dir`` (default ``.cache/dev`` in the checkout).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from weightroll_dev.devcluster.apiserver import REPO
from weightroll_dev.devcluster.bringup import CLUSTER_JSON, DevError, Options, down, up

__all__ = ["DEFAULT_DIR", "main"]

DEFAULT_DIR = REPO / ".cache" / "dev"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m weightroll_dev dev",
        description="A local dev cluster (from a checkout): kube-apiserver + etcd, the chart, "
        "the operator and N pods, each a real vLLM CPU server with the agent, run by a kubelet "
        "stand-in; checkpoints v1 (boot), v2 and v3 with manifests. `up` returns once the pods "
        "are Ready and leaves the cluster running; `down` stops everything it started.",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = sub.add_parser("up", help="start the cluster; returns when every pod is Ready")
    start.add_argument("--pods", type=int, default=3, help="pods of the workload (default 3)")
    start.add_argument(
        "--node",
        choices=("stand-in", "real"),
        default="stand-in",
        help="stand-in: our kubelet stand-in runs the pods (default); real: a real kubelet, "
        "containerd, scheduler and controller-manager in a network namespace (root; "
        "docs/real-node.md)",
    )
    stop = sub.add_parser("down", help="stop everything `dev up` started in --dir")
    for action in (start, stop):
        action.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_DIR,
            help=f"the cluster's directory: {CLUSTER_JSON}, logs, volumes, pods "
            f"(default {DEFAULT_DIR.relative_to(REPO)} in the checkout)",
        )
    start.add_argument(
        "--first-ip",
        type=int,
        default=10,
        help="pod IPs are 127.0.0.N from this N up (default 10); keep clusters apart",
    )
    start.add_argument(
        "--reference",
        metavar="VERSION",
        help="also start pod vllm-cold: vLLM alone booting VERSION cold (a reference engine)",
    )
    start.add_argument(
        "--inject",
        action="store_true",
        help="the example workload carries only the weightroll.io/inject label: the operator's "
        "pod-injection webhook (pointed at the local operator) prepares its pods",
    )
    start.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds allowed for the pods to become Ready (default 160 per pod, at least 300)",
    )
    return p


def _real_up(directory: Path, pods: int, timeout: float) -> int:
    from weightroll_dev.realnode import NodeError, devcluster

    try:
        info = devcluster.up(directory, pods, say=lambda line: print(line, flush=True),
                             timeout=timeout or 900)  # fmt: skip
    except NodeError as e:
        print(f"weightroll_dev dev up --node real: {e}", file=sys.stderr)
        return 1
    kubectl = (
        f"nsenter --net=/run/netns/{info['netns']} -- kubectl --kubeconfig {info['kubeconfig']}"
    )
    print(
        f"\nReal node up: {directory.resolve() / CLUSTER_JSON}\n"
        f"  {kubectl} get pods -n {info['namespace']}\n"
        + "".join(f"  {pod}: http://{ip}:8000/v1 (inside the namespace)\n"
                  for pod, ip in info["pods"].items())
        + f"  stop it: python -m weightroll_dev dev down --dir {directory}",
        flush=True,
    )  # fmt: skip
    return 0


def _real_down(directory: Path) -> int:
    from weightroll_dev.realnode import devcluster

    problems = devcluster.down(directory)
    for problem in problems:
        print(f"weightroll_dev dev down: left behind: {problem}", file=sys.stderr)
    if not problems:
        print(f"real node in {directory.resolve()} stopped", flush=True)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.action == "down":
            if (args.dir / "node").is_dir():
                return _real_down(args.dir)
            down(args.dir)
            print(f"dev cluster in {args.dir.resolve()} stopped", flush=True)
            return 0
        if args.pods < 1:
            print("weightroll_dev dev up: --pods must be at least 1", file=sys.stderr)
            return 2
        if args.node == "real":
            if args.inject or args.reference or args.first_ip != 10:
                # Not built for the real node yet: refuse rather than silently drop them.
                print("weightroll_dev dev up: --node real takes no --inject, --reference or "
                      "--first-ip (pods get bridge addresses)", file=sys.stderr)  # fmt: skip
                return 2
            return _real_up(args.dir, args.pods, args.timeout)
        info = up(
            Options(args.dir, args.pods, args.first_ip, args.reference, args.timeout, args.inject),
            say=lambda line: print(line, flush=True),
        )
    except DevError as e:
        print(f"weightroll_dev dev {args.action}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightroll_dev dev up: interrupted; everything started is stopped", file=sys.stderr)
        return 130
    print(
        f"\nDev cluster up: {Path(info.dir) / CLUSTER_JSON}\n"
        f"  kubectl --kubeconfig {info.kubeconfig} get pods -n {info.namespace}\n"
        + "".join(f"  {pod}: {url}\n" for pod, url in info.pods.items())
        + f"  checkpoints: {', '.join(info.checkpoints)} (source and manifest URIs in the json)\n"
        f"  stop it: python -m weightroll_dev dev down --dir {info.dir}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
