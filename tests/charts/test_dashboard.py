"""Chart tier: the Grafana dashboard ConfigMap (``grafanaDashboard``), offline.

Off by default; on, a ConfigMap with the sidecar's label carrying the dashboard JSON, whose panels
each query documented metrics (the e2e tier runs every query on a real Prometheus).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.charts.helpers import find, objects, render
from tests.harness import grafana

CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"


def test_off_by_default() -> None:
    assert not [o for o in objects(render()) if o["kind"] == "ConfigMap"]


def test_configmap_for_the_grafana_sidecar() -> None:
    values = {
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "additionalAnnotations": {"grafana_folder": "ML"},
        }
    }
    cm = find(objects(render(values)), "ConfigMap", "weightroll-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}
    assert json.loads(cm["data"]["weightroll.json"]) == grafana.load()
    relabelled = {"grafanaDashboard": {"enabled": True, "label": "dash", "labelValue": "yes"}}
    cm = find(objects(render(relabelled)), "ConfigMap", "weightroll-dashboard")
    assert (
        cm["metadata"]["labels"]["dash"] == "yes"
        and "grafana_dashboard" not in cm["metadata"]["labels"]
    )


def test_panels_cover_the_rollout_and_read_documented_metrics() -> None:
    dashboard = grafana.load()
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in (
        "Rollout progress (updated / total)",
        "Per-pod state and version",
        "Update duration by phase (p90)",
        "Verification failures by reason",
    ):
        assert wanted in titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(titles)
    contracts = CONTRACTS.read_text()
    for title, expr in grafana.queries(dashboard):
        metrics = set(re.findall(r"\bweightroll_[a-z_]+", expr))
        assert metrics, title
        for metric in metrics:
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            assert f"`{base}" in contracts, f"{title} reads {metric}, not in docs/contracts.md"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {
        "datasource",
        "namespace",
        "name",
    }


def test_as_promql_resolves_grafana_variables() -> None:
    expr = 'rate(x{namespace=~"$namespace", name=~"$name"}[$__rate_interval])'
    assert grafana.as_promql(expr, name="to-v2") == 'rate(x{namespace=~".*", name=~"to-v2"}[5m])'


def test_agent_podmonitor_scrapes_the_weightroll_port() -> None:
    assert not [o for o in objects(render()) if o["kind"] == "PodMonitor"]
    values = {"agentPodMonitor": {"enabled": True, "selector": {"matchLabels": {"app": "llama"}}}}
    pm = find(objects(render(values)), "PodMonitor", "weightroll-agents")
    assert pm["spec"]["selector"] == {"matchLabels": {"app": "llama"}}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("weightroll", "/metrics")
    with pytest.raises(Exception, match=r"agentPodMonitor\.selector is required"):
        render({"agentPodMonitor": {"enabled": True}})
