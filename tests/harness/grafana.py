"""The chart's Grafana dashboard as data: its panels' PromQL, with Grafana's variables resolved.

Used by the chart tests (every panel has a query over documented metrics) and the e2e tier (every
query parses and returns data on a real Prometheus after a rollout).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["DASHBOARD", "as_promql", "load", "queries"]

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "charts" / "weightroll" / "files" / "dashboards"
) / "weightroll.json"


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of every panel, in panel order."""
    return [
        (str(panel["title"]), str(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets") or []
    ]


def as_promql(expr: str, *, rate_interval: str = "5m", **variables: str) -> str:
    """``expr`` as Grafana sends it: ``$__rate_interval`` and the dashboard's variables replaced.

    A variable not given is "All" (the dashboard's ``allValue`` ``.*``).
    """
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), ".*"), expr)
