"""Issue 28 item 2 in the chart: ``workloadExample.trainerNetworks`` reaches the agent
(``WEIGHTROLL_AGENT_TRAINER_NETWORKS``) and every vLLM worker (``WEIGHTROLL_TRAINER_NETWORKS``),
empty leaves trainer pushes refused, and the NetworkPolicy admits exactly those networks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.helpers import CHART, find, helm_python, objects, render, with_crd_fallback

NETWORKS = ["10.42.0.0/16", "fd00:42::/64"]


def _workload(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    objs = objects(render({"workloadExample": {"enabled": True, "inject": False, **values}}))
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    return containers["vllm"], containers["weightroll-agent"], objs


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_trainer_networks_reach_the_agent_and_every_worker() -> None:
    vllm, agent, _ = _workload({"trainerNetworks": NETWORKS})
    assert _env(agent)["WEIGHTROLL_AGENT_TRAINER_NETWORKS"] == "10.42.0.0/16,fd00:42::/64"
    assert _env(vllm)["WEIGHTROLL_TRAINER_NETWORKS"] == "10.42.0.0/16,fd00:42::/64"


def test_without_trainer_networks_neither_container_accepts_a_trainer() -> None:
    vllm, agent, objs = _workload({})
    assert "WEIGHTROLL_AGENT_TRAINER_NETWORKS" not in _env(agent)  # the agent's default: none
    assert "WEIGHTROLL_TRAINER_NETWORKS" not in _env(vllm)
    policy = find(objs, "NetworkPolicy", "vllm-example-weightroll-agent")
    assert not [
        p for rule in policy["spec"]["ingress"] for p in rule.get("from", []) if "ipBlock" in p
    ]


def test_the_network_policy_admits_the_trainer_networks_on_every_port() -> None:
    _, _, objs = _workload({"trainerNetworks": NETWORKS})
    policy = find(objs, "NetworkPolicy", "vllm-example-weightroll-agent")
    trainer_rules = [
        rule
        for rule in policy["spec"]["ingress"]
        if any("ipBlock" in p for p in rule.get("from", []))
    ]
    # No `ports`: the transfer group (Gloo, NCCL) connects to ports the workers pick at run time.
    assert trainer_rules == [
        {"from": [{"ipBlock": {"cidr": "10.42.0.0/16"}}, {"ipBlock": {"cidr": "fd00:42::/64"}}]}
    ]


@pytest.mark.parametrize("bad", ["10.42.0.7", "trainers.example.com", "10.42.0.0/16,10.43.0.0/16"])
def test_schema_wants_one_cidr_per_entry(bad: str) -> None:
    chart = helm_python.Chart.load(str(CHART))
    try:
        values = {"workloadExample": {"enabled": True, "inject": False, "trainerNetworks": [bad]}}
        with pytest.raises(helm_python.HelmValuesError, match="/workloadExample/trainerNetworks/0"):
            chart.validate_schema(with_crd_fallback(values))
    finally:
        chart.close()


def test_trainers_get_their_own_token_secret_the_operator_never_reads() -> None:
    vllm, agent, objs = _workload({"trainerNetworks": NETWORKS})
    secret = find(objs, "Secret", "vllm-example-weightroll-trainer-token")
    assert set(secret["data"]) == {"token"}
    assert "weightroll.io/agent-token" not in secret["metadata"]["labels"]
    assert "--trainer-token-file=/var/run/weightroll-trainer/token" in agent["args"]
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["weightroll-trainer-token"] == {
        "name": "weightroll-trainer-token",
        "mountPath": "/var/run/weightroll-trainer",
        "readOnly": True,
    }
    assert "weightroll-trainer-token" not in {m["name"] for m in vllm.get("volumeMounts", [])}
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    trainer = volumes["weightroll-trainer-token"]["secret"]
    assert trainer["secretName"] == "vllm-example-weightroll-trainer-token"
    # Without trainer networks there are no trainers: no Secret, no flag, no mount.
    _, agent, objs = _workload({})
    assert not [o for o in objs if o["metadata"]["name"] == secret["metadata"]["name"]]
    assert not [a for a in agent["args"] if a.startswith("--trainer-token-file")]


def test_one_token_for_both_roles_is_refused() -> None:
    values = {
        "workloadExample": {
            "enabled": True,
            "inject": False,
            "trainerNetworks": NETWORKS,
            "tokenSecret": {"token": "same"},
            "trainerTokenSecret": {"token": "same"},
        }
    }
    with pytest.raises(helm_python.HelmRenderError, match="must differ"):
        render(values)
