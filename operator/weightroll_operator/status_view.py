"""``weightroll status NAME``: a WeightUpdate's phase, per-pod table, conditions and last events.

Reads only (the WeightUpdate and its Events); :func:`render` is pure and tested on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from weightroll_operator.errors import KubeError
from weightroll_operator.k8s.client import KubeApi, KubeConfig

__all__ = ["main", "render"]


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def render(body: Mapping[str, Any], events: Sequence[Mapping[str, Any]], last: int = 10) -> str:
    """The text shown by ``weightroll status`` for one WeightUpdate object and its Events."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    lines = [
        f"Name:      {meta.get('namespace')}/{meta.get('name')}",
        f"Version:   {spec.get('version')}  (stable: {status.get('stableVersion') or '-'})",
        f"Phase:     {status.get('phase', 'Pending')}",
        f"Message:   {status.get('message', '')}",
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
    lines += ["  " + x for x in _table(conds, ["TYPE", "STATUS", "REASON", "MESSAGE"])]
    pods = [
        [p.get("name", ""), p.get("state", ""), p.get("version") or "-", p.get("reason") or ""]
        for p in status.get("pods") or []
    ]
    lines += ["", "Pods:"] + ["  " + x for x in _table(pods, ["POD", "STATE", "VERSION", "REASON"])]
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
    lines += ["", "Events:"] + [
        "  " + x for x in _table(rows, ["TIME", "TYPE", "REASON", "MESSAGE"])
    ]
    return "\n".join(lines)


async def _fetch(api: KubeApi, namespace: str, name: str) -> tuple[Any, list[Any]]:
    try:
        body = await api.get_weightupdate(namespace, name)
        events = await api.list_events(namespace, name)
        return body, events
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightroll status", description=__doc__)
    p.add_argument("name", help="WeightUpdate name")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--kubeconfig")
    p.add_argument("--context")
    p.add_argument("--events", type=int, default=10, help="how many recent Events to show")
    args = p.parse_args(list(argv or []))
    try:
        config = KubeConfig.load(args.kubeconfig, args.context)
    except Exception as e:  # kubernetes' ConfigException, OSError, ...: all mean "no cluster"
        print(f"weightroll status: cannot load a kubeconfig: {e}", file=sys.stderr)
        return 2
    try:
        body, events = asyncio.run(_fetch(KubeApi(config), args.namespace, args.name))
    except KubeError as e:
        print(f"weightroll status: {e}", file=sys.stderr)
        return 1
    print(render(body, events, last=args.events))
    return 0
