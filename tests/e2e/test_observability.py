"""Observability for real (issue 13 E and G): pod Events, live alerts and the dashboard's queries
on the e2e fleet (the chart, the operator as its ServiceAccount, three real vLLM CPU engines with
their agents) and a real Prometheus (``tests/harness/prometheus.py``).

Prometheus scrapes the operator as the chart's ServiceMonitor would (job ``weightroll-metrics``,
the release namespace, its ``honorLabels``) and every agent as the chart's ``agentPodMonitor``
would (``namespace``, ``pod``), every second, with the rule groups of the rendered
PrometheusRule loaded. Test-only overrides (chart values, ``tests/charts/helpers.FAST_RULES``)
cut every alert's ``for`` to 2 s and the drained threshold to 5 s; the expressions are the
shipped ones.

The tests share one fleet and run in file order:

1. ``v1 -> v2`` succeeds; ``kubectl describe pod`` shows each pod's WeightsDrained,
   WeightsUpdating and WeightsVerified (with v2); no alert fires.
2. ``v2 -> v4`` with one pod's copy of v4 corrupt (``onFailure: Halt``): Failed;
   WeightrollUpdateFailed fires for it, WeightrollReplicaLeftDrained fires for the drained pod,
   whose Events say why it failed.
3. Every panel query of the chart's Grafana dashboard parses and returns data.
4. The retry: the same WeightUpdate is pointed at a good checkpoint ``v5`` (the retry that works
   on a halted rollout on main: clearing ``status.abortedAt`` alone halts again while the failed
   pod still counts against ``maxFailedReplicas``); it succeeds and both alerts resolve.
5. The operator is stopped: WeightrollOperatorDown fires (last: the fixture's teardown copes with
   a stopped operator).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from weightroll_dev.devcluster.operator_process import stop_process

from tests.charts.helpers import NAMESPACE as CHART_NAMESPACE
from tests.charts.helpers import find, objects, render, rule_groups
from tests.e2e import conftest as e2e
from tests.e2e.conftest import FIRST_UPDATE, GATE, NAMESPACE, PODS, Fleet
from tests.harness import grafana
from tests.harness.prometheus import Prometheus, Target, prometheus_binary

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.server,
    # the last test stops the operator: the shared fleet's other modules run first
    pytest.mark.ends_shared_cluster,
    pytest.mark.timeout(1500),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

AGENT_PORT = 8470
#: Seconds an alert may take from its condition to firing: scrape + evaluation (1 s each) + for.
ALERT_SLACK = 60
#: What the scenario reached (the tests run in file order on one fleet).
DONE: set[str] = set()


# The fleet is the e2e tier's (tests/e2e/conftest.py): these three read it whether it runs the
# dev cluster itself (simulator, operator process) or reads `weightroll_dev dev up`'s cluster.json.


def _operator_metrics_url(fleet: Fleet) -> str:
    info = getattr(fleet, "info", None)
    return str(info.operatorMetricsUrl if info is not None else fleet.metrics_url)  # type: ignore[attr-defined]


def _agent_address(fleet: Fleet, pod: str) -> str:
    info = getattr(fleet, "info", None)
    if info is not None:
        return urlparse(info.agents[pod]).netloc
    ip = fleet.sim.run(lambda: fleet.sim.simulator.pod_ip(pod))  # type: ignore[attr-defined]
    return f"{ip}:{AGENT_PORT}"


def _stop_operator(fleet: Fleet) -> None:
    info = getattr(fleet, "info", None)
    if info is None:
        stop_process(fleet.operator)  # type: ignore[attr-defined]
        return
    os.kill(info.operatorPid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while info.operator_alive() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def prom(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed: run `bash scripts/system-deps.sh`")
    assert NAMESPACE == CHART_NAMESPACE  # the rules are rendered for the release namespace
    monitor = find(objects(render({"serviceMonitor": {"enabled": True}})), "ServiceMonitor")
    operator = urlparse(_operator_metrics_url(fleet))
    targets = [
        Target(
            job="weightroll-metrics",
            address=operator.netloc,
            labels={"namespace": NAMESPACE},
            path=operator.path or "/metrics",
            honor_labels=bool(monitor["spec"]["endpoints"][0]["honorLabels"]),
        )
    ]
    for pod in PODS:
        targets.append(
            Target(
                job="weightroll-agent",
                address=_agent_address(fleet, pod),
                labels={"namespace": NAMESPACE, "pod": pod},
            )
        )
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), targets, rule_groups())
    with server:
        server.wait("every target up", lambda: _all_up(server), timeout=60)
        yield server


def _all_up(prom: Prometheus) -> bool:
    health = prom.targets_up()
    return len(health) == 1 + len(PODS) and all(h == "up" for h in health.values())


def _event_names(fleet: Fleet) -> set[str]:
    out = fleet.kubectl("get", "events", "-n", NAMESPACE, "-o", "json")
    return {e["metadata"]["name"] for e in json.loads(out)["items"]}


@pytest.fixture(scope="module")
def earlier(fleet: Fleet) -> set[str]:
    """The Events that were there before this module's first rollout: the shared fleet may have
    served other modules (and been reset to v1) before; this module judges only its own."""
    return _event_names(fleet)


def _pod_events(fleet: Fleet, pod: str, earlier: set[str]) -> list[dict[str, Any]]:
    """The operator's Events about ``pod`` since the module began, oldest first."""
    out = fleet.kubectl(
        "get",
        "events",
        "-n",
        NAMESPACE,
        "--field-selector",
        f"involvedObject.kind=Pod,involvedObject.name={pod}",
        "-o",
        "json",
    )
    events = [
        e
        for e in json.loads(out)["items"]
        if e.get("source", {}).get("component") and e["metadata"]["name"] not in earlier
    ]
    mine = [e for e in events if e["source"]["component"] == "weightroll-operator"]
    return sorted(mine, key=lambda e: (e["firstTimestamp"], e["metadata"]["name"]))


def _firing(prom: Prometheus, alert: str, **labels: str) -> list[dict[str, str]]:
    return [a for a in prom.alerts(alert) if all(a.get(k) == v for k, v in labels.items())]


def test_rollout_tells_each_pod_its_story(
    fleet: Fleet, prom: Prometheus, earlier: set[str]
) -> None:
    """v1 -> v2: Succeeded; each pod's Events, as ``kubectl describe pod`` shows them."""
    # the reference pod (a cold vLLM on v2) is not needed here: free its CPU
    cold = getattr(e2e, "COLD", getattr(e2e, "REFERENCE_POD", "vllm-cold"))
    fleet.kubectl("delete", "pod", cold, "-n", NAMESPACE, "--wait=false", check=False)
    fleet.apply_weightupdate("obs-v2", FIRST_UPDATE)
    status = fleet.wait_phase("obs-v2", "Succeeded", "Failed", timeout=300)
    assert status["phase"] == "Succeeded", status
    for pod in PODS:
        events = _pod_events(fleet, pod, earlier)
        assert [e["reason"] for e in events] == [
            "WeightsDrained",
            "WeightsUpdating",
            "WeightsVerified",
        ], events
        uid = fleet.pod(pod)["metadata"]["uid"]
        assert all(e["involvedObject"]["uid"] == uid for e in events)
        assert "Verified weights v2 on every rank" in events[-1]["message"]
        described = fleet.kubectl("describe", "pod", pod, "-n", NAMESPACE)
        assert "WeightsVerified" in described and "WeightsDrained" in described, described
    prom.wait(
        "the Succeeded phase scraped",
        lambda: prom.query(
            f'weightroll_update_phase{{namespace="{NAMESPACE}",name="obs-v2",phase="Succeeded"}}'
            " == 1"
        ),
        timeout=ALERT_SLACK,
    )
    for alert in ("WeightrollUpdateFailed", "WeightrollOperatorDown"):
        assert prom.alerts(alert) == [], alert
    # A unit in flight is drained, so under load a pod can pass the test-only 5 s threshold while
    # it updates: then the alert may still be listed until the rules are evaluated on the scrape
    # that saw the rollout finish. It must be gone then (scrape + evaluation, 1 s each).
    prom.wait(
        "WeightrollReplicaLeftDrained resolved after the rollout",
        lambda: not prom.alerts("WeightrollReplicaLeftDrained"),
        timeout=ALERT_SLACK,
    )
    DONE.add("v2")


def test_failed_rollout_fires_its_alerts(fleet: Fleet, prom: Prometheus, earlier: set[str]) -> None:
    """v2 -> v4 with one pod's v4 corrupt, Halt: WeightrollUpdateFailed and
    WeightrollReplicaLeftDrained fire; the drained pod's Events say why."""
    if "v2" not in DONE:
        pytest.skip("needs the fleet on v2 (test_rollout_tells_each_pod_its_story)")
    fleet.publish("v4", seed=3)
    bad = PODS[1]
    fleet.corrupt(bad, "v4")
    fleet.apply_weightupdate("obs-v4", "v4", on_failure="Halt")
    status = fleet.wait_phase("obs-v4", "Failed", "Succeeded", timeout=300)
    assert status["phase"] == "Failed", status
    assert fleet.condition(bad, GATE) == "False"
    failed = prom.wait(
        "WeightrollUpdateFailed firing for obs-v4",
        lambda: _firing(prom, "WeightrollUpdateFailed", namespace=NAMESPACE, name="obs-v4"),
        timeout=ALERT_SLACK,
    )
    assert failed[0]["phase"] == "Failed" and failed[0]["severity"] == "critical"
    drained = prom.wait(
        f"WeightrollReplicaLeftDrained firing for {bad}",
        lambda: _firing(prom, "WeightrollReplicaLeftDrained", pod=bad),
        timeout=ALERT_SLACK,
    )
    assert drained[0]["name"] == "obs-v4"
    assert not _firing(prom, "WeightrollUpdateFailed", name="obs-v2")
    events = _pod_events(fleet, bad, earlier)
    assert events[-1]["reason"] == "WeightsUpdateFailed", events
    assert events[-1]["type"] == "Warning"
    assert "failed:" in events[-1]["message"] and "stays drained" in events[-1]["message"]
    DONE.add("failed")


def test_every_dashboard_query_returns_data(fleet: Fleet, prom: Prometheus) -> None:
    """Each panel's PromQL (Grafana variables as "All", ``$__rate_interval`` 10m) parses and
    returns at least one sample that is a number, after a rollout and a failed one."""
    if "failed" not in DONE:
        pytest.skip("needs a finished and a failed rollout (the tests before)")
    empty: list[str] = []
    for title, expr in grafana.queries(grafana.load()):
        result = prom.query(grafana.as_promql(expr, rate_interval="10m"))
        values = [float(r["value"][1]) for r in result]
        if not [v for v in values if not math.isnan(v)]:
            empty.append(f"{title}: {expr} -> {result}")
    assert empty == []


def test_retry_succeeds_and_the_alerts_resolve(
    fleet: Fleet, prom: Prometheus, earlier: set[str]
) -> None:
    """The halted obs-v4 pointed at a good v5: Succeeded, every pod Ready, both alerts gone."""
    if "failed" not in DONE:
        pytest.skip("needs the failed rollout (test_failed_rollout_fires_its_alerts)")
    fleet.publish("v5", seed=4)
    fleet.apply_weightupdate("obs-v4", "v5", on_failure="Halt")
    status = fleet.wait_phase("obs-v4", "Succeeded", "Failed", timeout=300)
    assert status["phase"] == "Succeeded", status
    fleet.wait_pods("Ready", "True", PODS, timeout=60)
    prom.wait(
        "WeightrollUpdateFailed and WeightrollReplicaLeftDrained resolved",
        lambda: (
            not _firing(prom, "WeightrollUpdateFailed", name="obs-v4")
            and not _firing(prom, "WeightrollReplicaLeftDrained")
        ),
        timeout=ALERT_SLACK,
    )
    assert [e["reason"] for e in _pod_events(fleet, PODS[1], earlier)][-1] == "WeightsVerified"
    DONE.add("retried")


def test_operator_down_fires(fleet: Fleet, prom: Prometheus) -> None:
    """Last: the operator stopped, its scrape fails, WeightrollOperatorDown fires."""
    assert prom.alerts("WeightrollOperatorDown") == []
    began = time.monotonic()
    _stop_operator(fleet)
    prom.wait(
        "WeightrollOperatorDown firing",
        lambda: prom.alerts("WeightrollOperatorDown"),
        timeout=ALERT_SLACK,
    )
    fleet.timings["operator_down_alert_s"] = time.monotonic() - began
