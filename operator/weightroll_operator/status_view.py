"""``weightroll status NAME``: a WeightUpdate's phase, per-pod table, conditions and last events.

Reads only (the WeightUpdate and its Events); :func:`render` is pure and tested on its own
(``tests/unit/weightroll_operator/test_status_view.py`` holds golden texts for a running, a failed
and a succeeded update).

Errors are one line on stderr that says how to fix them: exit 2 when no kubeconfig can be
loaded, 1 when the API server cannot be reached or answers with an error (e.g. an unknown name).
The target arguments, the kubeconfig loading and those error lines are shared with the
``weightroll pause|resume|promote`` verbs (``control.py``), so every command names a cluster and
explains a failure the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from weightroll_operator.errors import KubeError, KubeNotFound, KubeUnavailable
from weightroll_operator.k8s.client import KubeApi, KubeConfig

__all__ = ["add_target_arguments", "kube_error_line", "load_config", "main", "render"]

_DESCRIPTION = (
    "Show one WeightUpdate: phase, version, replica counts, conditions, the per-pod table "
    "(failed pods always listed, with their reason) and the most recent Events. Read-only."
)
_EPILOG = (
    "Credentials: --kubeconfig, else the ServiceAccount when run in a pod, else $KUBECONFIG or "
    "~/.kube/config (as kubectl). Exit status: 0 shown, 1 the API server could not be reached "
    "or answered with an error (e.g. no such WeightUpdate), 2 bad usage or no kubeconfig."
)
_FORBIDDEN = "; your user may not get weightupdates.weightroll.io or list events in this namespace"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def _section(rows: list[list[str]], header: list[str]) -> list[str]:
    """An indented table, or ``(none)`` when there is no row."""
    return ["  " + x for x in _table(rows, header)] if rows else ["  (none)"]


def render(body: Mapping[str, Any], events: Sequence[Mapping[str, Any]], last: int = 10) -> str:
    """The text shown by ``weightroll status`` for one WeightUpdate object and its Events."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    lines = [
        f"Name:      {meta.get('namespace')}/{meta.get('name')}",
        f"Version:   {spec.get('version')}  (stable: {status.get('stableVersion') or '-'})",
        f"Phase:     {status.get('phase', 'Pending')}",
        f"Message:   {status.get('message') or _no_status(status)}",
        "Replicas:  "
        + ", ".join(
            f"{k} {replicas.get(k, 0)}"
            for k in ("total", "updated", "verified", "draining", "failed", "stale")
        ),
        "",
        "Conditions:",
    ]
    conds = [
        [c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("message", "")[:80]]
        for c in status.get("conditions") or []
    ]
    lines += _section(conds, ["TYPE", "STATUS", "REASON", "MESSAGE"])
    pod_list = status.get("pods") or []
    # The UNIT column only when pods are grouped (spec.groupBy): the unit is then the group.
    units = any(p.get("unit") for p in pod_list)
    pods = [
        [
            p.get("name", ""),
            *([p.get("unit") or "-"] if units else []),
            p.get("state", ""),
            p.get("version") or "-",
            p.get("reason") or "",
        ]
        for p in pod_list
    ]
    header = ["POD", *(["UNIT"] if units else []), "STATE", "VERSION", "REASON"]
    lines += ["", "Pods:", *_section(pods, header)]
    recent = sorted(events, key=lambda e: str(e.get("lastTimestamp") or ""))[-last:]
    rows = [
        [
            str(e.get("lastTimestamp") or ""),
            str(e.get("type") or ""),
            str(e.get("reason") or ""),
            str(e.get("message") or "")[:100],
        ]
        for e in recent
    ]
    lines += ["", "Events:", *_section(rows, ["TIME", "TYPE", "REASON", "MESSAGE"])]
    return "\n".join(lines)


def _no_status(status: Mapping[str, Any]) -> str:
    return "" if status else "no status yet: is the weightroll operator running?"


async def _fetch(api: KubeApi, namespace: str, name: str) -> tuple[Any, list[Any]]:
    try:
        body = await api.get_weightupdate(namespace, name)
        events = await api.list_events(namespace, name)
        return body, events
    finally:
        await api.close()


_UNAUTHORIZED = "; the kubeconfig's credentials were refused: refresh them (kubectl get wu works?)"


def _not_found(error: KubeNotFound, namespace: str, name: str) -> str:
    """One line for a 404: the object is missing, or the CRD itself is not installed."""
    if "could not find the requested resource" in str(error):
        return (
            "the API server does not serve weightupdates.weightroll.io; install the CRD "
            "(helm install weightroll charts/weightroll, or kubectl apply -f crds/)"
        )
    return (
        f"WeightUpdate {namespace}/{name} not found; list them with "
        f"`kubectl get weightupdates -n {namespace}` (or -A), or pass -n NAMESPACE"
    )


def kube_error_line(
    error: KubeError, server: str, namespace: str, name: str, *, forbidden: str
) -> str:
    """The one line (without the ``weightroll VERB:`` prefix) that explains a failed API call.

    Args:
        error: what the client raised.
        server: the API server's URL, named when it cannot be reached.
        namespace: namespace of the WeightUpdate.
        name: name of the WeightUpdate.
        forbidden: the hint appended to a 403, naming what the caller's user must be allowed.

    Returns:
        The cause and its fix: not found (or no CRD), unreachable, 401, 403, or the API's message.
    """
    if isinstance(error, KubeNotFound):
        return _not_found(error, namespace, name)
    if isinstance(error, KubeUnavailable):
        return (
            f"cannot reach the API server {server} ({error}); check "
            "--kubeconfig/--context and that the cluster is up"
        )
    hint = {401: _UNAUTHORIZED, 403: forbidden}.get(error.status, "")
    return f"{error}{hint}"


def load_config(prog: str, kubeconfig: str | None, context: str | None) -> KubeConfig | None:
    """The cluster to talk to, or ``None`` after printing one line on stderr saying why not.

    Args:
        prog: the command, e.g. ``weightroll status``, that prefixes the error line.
        kubeconfig: ``--kubeconfig``; ``None`` for in-cluster, then ``$KUBECONFIG``.
        context: ``--context``; ``None`` for the current context.
    """
    try:
        return KubeConfig.load(kubeconfig, context)
    except Exception as e:  # kubernetes' ConfigException, OSError, ...: all mean "no cluster"
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(
            f"{prog}: cannot load a kubeconfig ({detail}); pass --kubeconfig FILE "
            "or set KUBECONFIG to a file with a reachable cluster",
            file=sys.stderr,
        )
        return None


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``NAME``, ``-n/--namespace``, ``--kubeconfig`` and ``--context``: which WeightUpdate."""
    parser.add_argument("name", metavar="NAME", help="name of the WeightUpdate (kubectl get wu)")
    parser.add_argument(
        "-n",
        "--namespace",
        default="default",
        help="namespace of the WeightUpdate (default: default)",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)",
    )
    parser.add_argument("--context", help="kubeconfig context (default: the current context)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightroll status", description=_DESCRIPTION, epilog=_EPILOG)
    add_target_arguments(p)
    p.add_argument(
        "--events", type=int, default=10, metavar="N", help="how many recent Events to show (10)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the view of one WeightUpdate; see the module docstring for exit statuses."""
    args = _parser().parse_args(list(argv or []))
    config = load_config("weightroll status", args.kubeconfig, args.context)
    if config is None:
        return 2
    try:
        body, events = asyncio.run(_fetch(KubeApi(config), args.namespace, args.name))
    except KubeError as e:
        line = kube_error_line(e, config.server, args.namespace, args.name, forbidden=_FORBIDDEN)
        print(f"weightroll status: {line}", file=sys.stderr)
        return 1
    print(render(body, events, last=args.events))
    return 0
