"""The operator's metric names are exactly the ones docs/contracts.md lists."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from weightroll_operator.api.v1alpha1 import Phase, ReplicaCounts
from weightroll_operator.metrics import Metrics

CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "contracts.md"


def _contract_names() -> set[str]:
    text = CONTRACTS.read_text()
    section = text.split("Operator (`weightroll_` prefix", 1)[1].split(
        "Agent (`weightroll_agent_", 1
    )[0]
    return set(re.findall(r"`(weightroll_[a-z_]+)", section))


def test_metric_names_match_the_contract() -> None:
    m = Metrics()
    m.observe_status("ns", "wu", Phase.PROGRESSING, ReplicaCounts(total=3), 600, 1.0)
    m.observe_transition("ns", "wu", Phase.PROGRESSING, Phase.SUCCEEDED, 12.0)
    m.observe_units("ns", "wu", {"p0": "failed"}, {"p0": 3.0}, {"p0": "UpdateFailed: digest"})
    m.observe_pods("ns", "wu", {"p0": 1.0}, {"p0": True})
    m.observe_pod_states("ns", "wu", {"p0": ("Failed", "v2")})
    m.observe_admitted("ns")
    exposed = generate_latest(m.registry).decode()
    names = {f.name + "_total" if f.type == "counter" else f.name for f in m.registry.collect()}
    assert names == _contract_names()
    assert 'weightroll_updates_total{name="wu",namespace="ns",outcome="succeeded"} 1.0' in exposed
    assert 'weightroll_update_phase{name="wu",namespace="ns",phase="Progressing"} 1.0' in exposed
    assert 'weightroll_pods_admitted_total{namespace="ns"} 1.0' in exposed
    assert (
        'weightroll_verification_failures_total{name="wu",namespace="ns",reason="UpdateFailed"}'
        in exposed
    )


def test_per_pod_series_are_removed_when_no_longer_reported() -> None:
    m = Metrics()
    m.observe_pods("ns", "wu", {"p0": 1.0, "p1": 2.0}, {"p0": True})
    m.observe_pods("ns", "wu", {"p1": 2.0}, {})
    exposed = generate_latest(m.registry).decode()
    assert 'pod="p1"' in exposed and 'pod="p0"' not in exposed


def test_pod_state_keeps_one_series_per_pod() -> None:
    m = Metrics()
    m.observe_pod_states("ns", "wu", {"p0": ("Pending", ""), "p1": ("Verified", "v1")})
    m.observe_pod_states("ns", "wu", {"p0": ("Draining", "v2"), "p1": ("Verified", "v1")})
    m.observe_pod_states("ns", "wu", {"p0": ("Verified", "v2")})
    exposed = generate_latest(m.registry).decode()
    series = sorted(line for line in exposed.splitlines() if line.startswith("weightroll_pod_"))
    assert series == [
        'weightroll_pod_state{name="wu",namespace="ns",pod="p0",state="Verified",version="v2"} 1.0'
    ]


def _fill(m: Metrics, name: str) -> None:
    m.observe_status("ns", name, Phase.FAILED, ReplicaCounts(total=3, failed=1), 600, 1.0)
    m.observe_transition("ns", name, Phase.PROGRESSING, Phase.FAILED, 12.0)
    m.observe_units("ns", name, {"p0": "failed"}, {"p0": 3.0}, {"p0": "UpdateFailed: digest"})
    m.observe_pods("ns", name, {"p0": 1.0}, {"p0": True})
    m.observe_pod_states("ns", name, {"p0": ("Failed", "v2")})


def test_forget_removes_every_series_of_a_deleted_weightupdate_and_only_those() -> None:
    m = Metrics()
    _fill(m, "gone")
    _fill(m, "kept")
    m.observe_admitted("ns")
    assert m.forget("ns", "gone") > 0
    exposed = generate_latest(m.registry).decode()
    assert 'name="gone"' not in exposed
    assert 'weightroll_update_phase{name="kept",namespace="ns",phase="Failed"} 1.0' in exposed
    assert 'weightroll_pods_admitted_total{namespace="ns"} 1.0' in exposed
    assert m.forget("ns", "gone") == 0  # idempotent
    m.observe_pods("ns", "gone", {}, {})  # a late pass starts from scratch, nothing stale
    assert 'name="gone"' not in generate_latest(m.registry).decode()


def test_forget_knows_every_metric_labelled_by_weightupdate() -> None:
    m = Metrics()
    labelled = {
        c._name for c in m.registry._collector_to_names if "name" in getattr(c, "_labelnames", ())
    }
    assert labelled == {c._name for c in m._per_weightupdate()}
