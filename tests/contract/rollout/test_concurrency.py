"""Optimistic concurrency of the operator's pod writes (issue 11 finding 6), against kmock.

Two passes that planned from the same observation of the fleet — two operator replicas
overlapping during a failover — must never both claim or drain one pod: every pod write is
conditional on the ``resourceVersion`` the pass read, so the second writer gets 409, stops that
pod's chain and re-plans on its next pass. (Two WeightUpdates created in the same second never
get that far: precedence decides before any drain, ``domain/ownership.py``, see
``test_fleet_noise.py``.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from weightroll_operator.domain.actions import GateOn
from weightroll_operator.errors import KubeConflict

from tests.contract.rollout.harness import NS, Harness

pytestmark = pytest.mark.asyncio


async def _versioned_pods(h: Harness, n: int) -> None:
    """``n`` pods that carry a resourceVersion (kmock keeps none of its own)."""
    await h.add_pods(n)
    headers = {"Content-Type": "application/merge-patch+json"}
    for i in range(n):
        path = f"/api/v1/namespaces/{NS}/pods/pod-{i}"
        body = {"metadata": {"resourceVersion": "1"}}
        async with h.http.patch(path, json=body, headers=headers) as resp:
            assert resp.status < 400


def _drains(h: Harness) -> Counter[str]:
    return Counter(w.pod for w in h.emu.status_writes if w.gate() == "False")


async def test_two_replicas_from_one_observation_never_share_a_pod(h: Harness) -> None:
    await _versioned_pods(h, 4)
    await h.create_wu("a", "v2", strategy={"maxUnavailable": 2})
    pods, peers = await h.pods(), await h.kube.list_weightupdates(NS)
    wu_a = await h.wu("a")
    rec_b = h.new_reconciler()  # a second operator replica during a failover

    first_a, first_b = await asyncio.gather(
        h.rec.reconcile(wu_a, pods, peers), rec_b.reconcile(wu_a, pods, peers)
    )

    # Each pod was drained at most once, by the WeightUpdate that owns it now.
    drains = _drains(h)
    assert drains and max(drains.values()) == 1, drains
    for pod in drains:
        state = await h.state_of(pod)
        assert state is not None
        assert state.by == await h.owner_of(pod)
    # The pass that lost a race saw a conflict, not a silent overwrite.
    conflicts = [r for r in (*first_a.errors, *first_b.errors) if isinstance(r.error, KubeConflict)]
    assert conflicts, "both passes claimed the same pods and neither was refused"

    # Later passes re-read and re-plan: the rollout finishes, nothing was ever marked ready
    # unverified, and the budget held across both replicas.
    await h.run_until(["a"], h.phase_is("a", "Succeeded"), timeout=30)
    status_a = await h.status("a")
    assert status_a["replicas"]["verified"] == 4
    h.assert_never_ready_unverified({"v1", "v2"})
    assert h.max_drained_at_once() <= 2


async def test_a_stale_observation_cannot_undo_a_newer_write(h: Harness) -> None:
    """The kruise#2276 shape: a pass planned from a pod version older than the last write is
    refused, instead of flipping the gate back."""
    await _versioned_pods(h, 1)
    await h.create_wu("wu", "v2")
    stale = await h.pods()
    await h.tick("wu")  # claims and drains pod-0 (its version moves on)
    assert await h.gate("pod-0") == "False"
    writes_before = len(h.emu.status_writes)

    result = await h.new_reconciler().reconcile(
        await h.wu("wu"), stale, await h.kube.list_weightupdates(NS)
    )

    assert len(h.emu.status_writes) == writes_before, "a write planned on a stale pod landed"
    assert any(isinstance(r.error, KubeConflict) for r in result.errors)
    assert await h.gate("pod-0") == "False"


async def _bump(h: Harness, pod: str) -> None:
    """Another writer (kubelet, a label controller) changes ``pod``: its version moves on."""
    headers = {"Content-Type": "application/merge-patch+json"}
    body = {"metadata": {"labels": {"touched": str(time.monotonic_ns())}}}
    async with h.http.patch(f"/api/v1/namespaces/{NS}/pods/{pod}", json=body, headers=headers) as r:
        assert r.status < 400


async def _true(value: bool) -> bool:
    return value


def _unit_samples(h: Harness) -> float:
    value = h.metrics.registry.get_sample_value(
        "weightroll_unit_update_duration_seconds_count",
        {"namespace": NS, "name": "wu", "outcome": "succeeded"},
    )
    return value or 0.0


async def test_a_completion_refused_by_a_conflict_is_reported_once_when_it_happens(
    h: Harness,
) -> None:
    """A unit's GateOn + Settle refused with 409 (the pod changed after the pass read it) did
    not verify the unit: no ``UnitVerified`` Event and no unit-duration sample for that pass.
    The next pass completes it and reports it, once (both were reported twice)."""
    await _versioned_pods(h, 1)
    await h.create_wu("wu", "v2")
    agent = h.agents["pod-0"]
    await h.run_until(["wu"], lambda: _true(agent.active is not None))  # claimed and started
    for _ in range(500):  # the agent commits on its own; no pass meanwhile
        if agent.active is None:
            break
        await asyncio.sleep(0.01)
    assert agent.committed_version == "v2", agent.snapshot()
    stale = await h.pods()
    await _bump(h, "pod-0")  # after the read: every write of the next pass is refused
    refused = await h.rec.reconcile(await h.wu("wu"), stale, await h.kube.list_weightupdates(NS))

    assert any(isinstance(a, GateOn) for a in refused.actions), refused.actions
    assert any(isinstance(r.error, KubeConflict) for r in refused.errors), refused.errors
    assert await h.gate("pod-0") == "False"
    events = [e["reason"] for e in await h.kube.list_events(NS, "wu")]
    assert "UnitVerified" not in events, "verified before the gate and the state were written"
    assert _unit_samples(h) == 0

    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))

    assert await h.gate("pod-0") == "True"
    events = [e["reason"] for e in await h.kube.list_events(NS, "wu")]
    assert events.count("UnitVerified") == 1, events
    assert _unit_samples(h) == 1
