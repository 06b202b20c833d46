"""A ``helm install`` stand-in on helm-python-sdk, for docs whose commands a test runs.

This machine has no ``helm`` binary; helm-python-sdk is Helm's own Go library behind a Python
API. ``python -m tests.harness.helm_cli install RELEASE CHART -n NS [--create-namespace]
[--set KEY=VALUE ...]`` parses what ``helm install`` would and installs CHART with
``dry_run="server"`` against ``$KUBECONFIG``: Helm renders the chart with the API server's
``lookup``, maps every object to a resource the server knows, and checks each cluster-scoped
object against the release that owns it (a release of the same name in another namespace is
refused, as ``helm install`` refuses it), but creates nothing. It is a dry run because the dev
cluster installs the same chart as the same release before its simulated pods start (the
kubelet stand-in runs the pods the release's workload describes); the test checks that the
release this command names is the one deployed there.

``--set`` follows Helm's ``strvals`` for what docs use: dotted keys, ``true``/``false`` as
booleans, integers as ints, ``{a,b}`` as a list, anything else a string.

Limitations:
    Only ``install`` with the flags above; anything else exits 2 naming what is unsupported, so
    a doc that grows a new flag fails its test instead of being run differently.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "parse_set", "set_values"]


def parse_set(value: str) -> Any:
    """One ``--set`` value as Helm's ``strvals`` types it."""
    if value in ("true", "false"):
        return value == "true"
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    if value.startswith("{") and value.endswith("}"):
        return [parse_set(v) for v in value[1:-1].split(",") if v]
    return value


def set_values(assignments: Sequence[str]) -> dict[str, Any]:
    """``["a.b=c", ...]`` -> ``{"a": {"b": "c"}}``: the values ``helm install --set`` passes."""
    values: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parse_set(raw)
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helm", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    install = sub.add_parser("install")
    install.add_argument("release")
    install.add_argument("chart")
    install.add_argument("-n", "--namespace", required=True)
    install.add_argument("--create-namespace", action="store_true")
    install.add_argument("--set", action="append", default=[], dest="sets")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import helm_python
    from helm_python.errors import HelmError

    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        print("helm (stand-in): $KUBECONFIG is not set", file=sys.stderr)
        return 2
    values = set_values(args.sets)
    config = helm_python.Config(kubeconfig_path=kubeconfig, namespace=args.namespace)
    try:
        release = config.install(
            args.chart,
            args.release,
            values,
            namespace=args.namespace,
            create_namespace=args.create_namespace,
            dry_run="server",
        )
    except HelmError as e:
        print(f"Error: INSTALLATION FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        config.close()
    print(f"NAME: {release['name']}\nNAMESPACE: {release['namespace']}\nSTATUS: dry run (server)")
    print(release.get("notes", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
