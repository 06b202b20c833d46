"""Chart tier: the chart's rules on a real Prometheus scraping the operator's real metrics.

The operator's :class:`~weightroll_operator.metrics.Metrics` is served over HTTP in this process
(the exposition the operator serves), and a Prometheus server (``tests/harness/prometheus.py``)
scrapes it as the chart's ServiceMonitor would (job ``weightroll-metrics``, the release
namespace, ``honorLabels``) with the rendered PrometheusRule loaded (test-only ``for``
overrides, ``FAST_RULES``). Every rule evaluates without error; WeightrollUpdateFailed fires on a
Failed phase and resolves when the phase moves on; WeightrollOperatorDown fires once the
operator's endpoint stops answering. The same rules on the real fleet:
``tests/e2e/test_observability.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import start_http_server
from weightroll_operator.api.v1alpha1 import Phase, ReplicaCounts
from weightroll_operator.metrics import Metrics

from tests.charts.helpers import ALERTS, NAMESPACE, find, objects, render, rule_groups
from tests.harness.ports import free_port
from tests.harness.prometheus import Prometheus, Target, prometheus_binary

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[Metrics, Prometheus, object]]:
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed: run `bash scripts/system-deps.sh`")
    metrics = Metrics()
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    monitor = find(objects(render({"serviceMonitor": {"enabled": True}})), "ServiceMonitor")
    honor = bool(monitor["spec"]["endpoints"][0]["honorLabels"])
    target = Target(
        job="weightroll-metrics",
        address=f"127.0.0.1:{port}",
        labels={"namespace": NAMESPACE},
        honor_labels=honor,
    )
    prom = Prometheus(tmp_path / "prom", [target], rule_groups())
    try:
        with prom:
            yield metrics, prom, server
    finally:
        server.shutdown()


def test_rules_fire_and_resolve_on_a_real_prometheus(
    served: tuple[Metrics, Prometheus, object],
) -> None:
    metrics, prom, server = served
    metrics.observe_status("ml", "llama", Phase.FAILED, ReplicaCounts(total=2, failed=1), 60, 1.0)
    health = prom.wait("every rule evaluated", lambda: _all_evaluated(prom), timeout=60)
    assert set(health) == set(ALERTS), health
    assert all(h == "ok" for h in health.values()), health
    # the WeightUpdate's namespace survives the scrape (honorLabels): alerts group by it
    firing = prom.wait(
        "WeightrollUpdateFailed firing",
        lambda: prom.alerts("WeightrollUpdateFailed"),
        timeout=60,
    )
    assert firing[0]["namespace"] == "ml" and firing[0]["name"] == "llama"
    assert firing[0]["phase"] == "Failed" and firing[0]["severity"] == "critical"
    assert prom.alerts("WeightrollOperatorDown", "pending") == []
    assert prom.alerts("WeightrollOperatorDown") == []

    metrics.observe_status("ml", "llama", Phase.PROGRESSING, ReplicaCounts(total=2), 60, 1.0)
    prom.wait(
        "WeightrollUpdateFailed resolved",
        lambda: (
            not prom.alerts("WeightrollUpdateFailed")
            and not prom.alerts("WeightrollUpdateFailed", "pending")
        ),
        timeout=60,
    )

    server.shutdown()  # type: ignore[attr-defined]
    prom.wait(
        "WeightrollOperatorDown firing",
        lambda: prom.alerts("WeightrollOperatorDown"),
        timeout=60,
    )


def _all_evaluated(prom: Prometheus) -> dict[str, str] | None:
    health = prom.rule_health()
    return health if health and all(h != "unknown" for h in health.values()) else None


def test_a_query_error_is_reported(served: tuple[Metrics, Prometheus, object]) -> None:
    _, prom, _ = served
    with pytest.raises(Exception, match="bad_data"):
        prom.query("sum by (x (up)")
