"""The chart, the operator and vLLM pods on the real node (``dev up --node real``), and a rollout
judged from the EndpointSlices the real controller-manager writes.

Two vLLM CPU pods with the agent sidecar (BestEffort: the machine has 2 cores): the real
scheduler places them, the real kubelet runs their probes and reports Ready only once the
operator set the ``weightroll.io/weights-ready`` gate. Then a WeightUpdate v1 -> v2 must reach
``Succeeded`` while, in every sample of the Service's EndpointSlices
(:mod:`weightroll_dev.realnode.sampler`), at most ``maxUnavailable`` selected pods are out of
the ready endpoints and no ready endpoint's agent reports anything but v1 or v2, ready and not
inside an update. Root, the node binaries and vLLM needed; otherwise skipped with the reason.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from weightroll_dev.realnode.config import POD_SUBNET
from weightroll_dev.realnode.sampler import budget_breaches, judge

from tests.harness.realnode_fleet import (
    GATE,
    RealFleet,
    condition,
    iter_out_of_endpoints,
    ready_at,
    realnode_marks,
)

pytestmark = realnode_marks()

PODS = 2


def test_pods_are_made_ready_by_the_kubelet_through_the_gate(real_fleet: RealFleet) -> None:
    pods = real_fleet.pods().values()
    assert len(pods) == PODS
    for pod in pods:
        assert pod["spec"]["nodeName"] == "weightroll-node"  # placed by the real scheduler
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
        assert pod["spec"]["readinessGates"] == [{"conditionType": GATE}]
        assert condition(pod, GATE) == "True"  # the operator's write
        assert condition(pod, "ContainersReady") == "True"  # the kubelet's probes
        assert condition(pod, "Ready") == "True"  # the kubelet's verdict of both
        names = {c["name"]: c["ready"] for c in pod["status"]["containerStatuses"]}
        assert names == {"vllm": True, "weightroll-agent": True}


def test_rollout_keeps_the_budget_and_no_unverified_endpoint(
    real_fleet: RealFleet, tmp_path: Path
) -> None:
    with real_fleet.sampling(tmp_path / "samples.jsonl") as sampler:
        # The Service's slice must show both pods ready before the rollout starts.
        sampler.wait("the EndpointSlice shows both pods ready", ready_at(PODS), timeout=60)
        real_fleet.apply_weightupdate("to-v2", "v2")
        real_fleet.wait_succeeded("to-v2", "v2")
        # Both pods back as ready endpoints on v2 (the sampler sees the end state too).
        sampler.wait("both pods back as v2 endpoints", ready_at(PODS, "v2"), timeout=60)
    good = sampler.rounds()
    assert len(good) >= 10, f"only {len(good)} samples"
    budget = [b for r in good for b in budget_breaches(r, max_unavailable=1)]
    verdict = judge(good, accepted=("v1", "v2"))
    assert not budget, budget[:5]
    assert not verdict.unverified, verdict.unverified[:5]
    assert not verdict.dead, verdict.dead[:5]
    # The rollout was observed: each pod out of the endpoints while it updated.
    pods: dict[str, Any] = good[0]["pods"]
    assert all(any(iter_out_of_endpoints(good, name)) for name in pods), "no pod seen out"
