"""Ordinary cluster noise against the reconciler, on kmock (issue 27 items 2, 3, 5, 6, 11).

Readiness blips, WeightUpdates that overlap, a pod deleted while the watch was down, an agent
that no longer serves what it was verified at: each must leave the budget, the ownership of
the pods and the status as a user of Deployments expects (docs/api.md, "Budget" and "Several
WeightUpdates").
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from weightroll_operator.api import v1alpha1 as api

from tests.contract.rollout.harness import NS, Harness
from tests.harness.kube_fleet import make_weightupdate

pytestmark = pytest.mark.asyncio


async def _create_wu(h: Harness, name: str, version: str, created: str, **kw: Any) -> None:
    """A WeightUpdate with the ``creationTimestamp`` the API server would give it (kmock sets
    none)."""
    kw.setdefault("agent", {"tokenSecretRef": {"name": "agent-token"}})
    body = make_weightupdate(name, version, **kw)
    body["metadata"]["creationTimestamp"] = created
    await h._post(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}", body)


async def test_a_readiness_blip_does_not_let_claims_pass_the_budget(h: Harness) -> None:
    """Item 2: 3 of 4 pods NotReady for a moment at the first pass (our gate still True). A
    claim keeps a pod out of traffic for its whole reload, so it takes a slot: one pod out."""
    await h.add_pods(4, step=0.05)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    for i in (1, 2, 3):
        await h.emu.kubelet_update(f"pod-{i}", ready=False)
    await h.tick("wu")
    for i in (1, 2, 3):
        await h.emu.kubelet_update(f"pod-{i}", ready=True)
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert h.max_drained_at_once() == 1
    h.assert_never_ready_unverified({"v2"})


async def test_weightupdates_created_together_decide_ownership_before_any_drain(
    h: Harness,
) -> None:
    """Item 3: two WeightUpdates over the same pods, created in the same second, passes run
    from one observation (neither has a status yet), the younger first. The older goes first,
    the younger waits (Blocked) and then converges the pods: each pod is loaded twice, never
    three times, and the budget holds across both."""
    await h.add_pods(3, step=0.03)
    same_second = "2026-01-01T10:00:00Z"
    await _create_wu(h, "a", "v2", same_second, strategy={"maxUnavailable": 1})
    await _create_wu(h, "b", "v3", same_second, strategy={"maxUnavailable": 1})
    pods, peers = await h.pods(), await h.kube.list_weightupdates(NS)
    await h.rec.reconcile(await h.wu("b"), pods, peers)
    await h.rec.reconcile(await h.wu("a"), pods, peers)
    drains = [w.pod for w in h.emu.status_writes if w.gate() == "False"]
    assert len(drains) == 1, drains  # one drain, by the older one only
    assert await h.owner_of(drains[0]) == f"{NS}/a"
    blocked = h.condition(await h.status("b"), "Blocked")
    assert blocked["status"] == "True" and f"{NS}/a" in blocked["message"]

    await h.run_until(["b", "a"], h.phase_is("b", "Succeeded"), timeout=30)
    assert (await h.status("a"))["phase"] == "Succeeded"
    for i in range(3):
        assert h.agents[f"pod-{i}"].version == "v3"
        assert [r.split("-")[0] for r in h.agents[f"pod-{i}"].runs] == ["a", "b"]
    assert h.max_drained_at_once() == 1
    h.assert_never_ready_unverified({"v2", "v3"})


async def test_a_new_pod_goes_to_the_newest_weightupdate(h: Harness) -> None:
    """Item 11: two Succeeded WeightUpdates select the fleet (the younger finished after the
    older). A new pod is the younger's: the older one's pass, run first, leaves it alone."""
    await h.add_pods(2, step=0.02)
    await _create_wu(h, "a", "v2", "2026-01-01T10:00:00Z", strategy={"maxUnavailable": 2})
    await h.run_until(["a"], h.phase_is("a", "Succeeded"))
    await _create_wu(h, "b", "v3", "2026-01-01T11:00:00Z", strategy={"maxUnavailable": 2})
    await h.run_until(["a", "b"], h.phase_is("b", "Succeeded"))

    await h.add_pods(1, start=2, gate=None)  # joins on boot weights, not admitted yet
    await h.run_until(["a", "b"], h.phase_is("b", "Succeeded"))
    await h.run_until(["a", "b"], lambda: _gate_true(h, "pod-2"))
    assert h.agents["pod-2"].version == "v3"
    assert [r.split("-")[0] for r in h.agents["pod-2"].runs] == ["b"]
    status_a, status_b = await h.status("a"), await h.status("b")
    assert status_a["phase"] == status_b["phase"] == "Succeeded"
    assert status_b["replicas"]["verified"] == 3
    h.assert_never_ready_unverified({"v2", "v3"})


async def _gate_true(h: Harness, pod: str) -> bool:
    return await h.gate(pod) == "True"


@pytest.mark.parametrize("drift", ["agent restarted without state", "trainer push"])
async def test_a_verified_pod_that_no_longer_serves_the_version_is_converged_again(
    h: Harness, drift: str
) -> None:
    """Item 6: a verified, Ready pod in traffic whose agent now serves other weights (boot
    weights after a restart without state, or a push under the same label) is asked again,
    reported, and updated again within the budget."""
    await h.add_pods(3, step=0.02)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    agent = h.agents["pod-1"]
    if drift == "trainer push":
        agent.source, agent.committed_id = "/push/step-812", "trainer-push-812"
    else:
        agent.version, agent.source = "v1", "/weights/v1"
        agent.committed_version, agent.committed_id = "v1", None
    await h.tick("wu")
    status = await h.status("wu")
    assert status["replicas"]["verified"] == 2, status["replicas"]

    async def converged() -> bool:
        st = await h.status("wu")
        return st.get("phase") == "Succeeded" and st["replicas"]["verified"] == 3

    await h.run_until(["wu"], converged)
    assert agent.version == "v2" and agent.source == "/weights/v2"
    assert len(agent.runs) == 2
    assert h.max_drained_at_once() == 1
    h.assert_never_ready_unverified({"v2"})


async def test_a_pod_deleted_while_the_watch_was_down_is_released_not_timed_out(
    h: Harness,
) -> None:
    """Item 5: a claimed pod deleted while the watch was down: kopf's index keeps it after the
    410 re-list (kopf drops no entry a new listing lacks), so passes still get its last object.
    The operator asks the API server, leaves the pod out, and neither times its unit out (no
    halt) nor holds the WeightUpdate's deletion for it."""
    await h.add_pods(3, step=0.02)
    h.agents["pod-0"].scripts["v2"] = "hang"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1, "updateTimeoutSeconds": 60})
    await h.tick("wu")
    assert await h.owner_of("pod-0") == f"{NS}/wu"
    phantom = await h.pod("pod-0")  # what the index keeps

    await h.agents["pod-0"].disappear()
    await h.delete_pod("pod-0")

    async def index() -> list[dict[str, Any]]:
        return [phantom, *await h.pods()]

    async def one_pass() -> None:
        peers = await h.kube.list_weightupdates(NS)
        await h.rec.reconcile(await h.wu("wu"), await index(), peers)

    h.advance(200)  # past the unit timeout and its abort grace, within the progress deadline
    for _ in range(200):
        await one_pass()
        if (await h.status("wu")).get("phase") == "Succeeded":
            break
        await asyncio.sleep(h.tick_interval)  # the agents' steps take (virtual) time
    status = await h.status("wu")
    assert status["phase"] == "Succeeded", (status.get("abortReason"), status.get("pods"))
    assert status["replicas"]["total"] == 2 and not status.get("abortReason")
    released = await h.rec.finalize(await h.wu("wu"), await index())
    assert released == 0  # nothing left to release: the phantom is not waited for


async def test_a_claim_made_on_an_index_lacking_an_older_peer_is_dropped(h: Harness) -> None:
    """Item 3, the index lagging: the younger WeightUpdate's pass is handed no peers (its index
    does not hold the older one yet), so its plan claims a pod. The claim rests on precedence
    (``Premise.peers``): the API server's list has the older one, so the claim is dropped from
    the pass (no write, no Event, not counted in flight) and the next pass is polled for (the
    index catches up on a watch event; back to back, a lagging watch would make the loop list
    the namespace's WeightUpdates without a pause)."""
    await h.add_pods(2, step=0.03)
    await _create_wu(h, "a", "v2", "2026-01-01T10:00:00Z", strategy={"maxUnavailable": 1})
    await _create_wu(h, "b", "v3", "2026-01-01T10:00:01Z", strategy={"maxUnavailable": 1})
    result = await h.rec.reconcile(await h.wu("b"), await h.pods(), [])
    assert [a for a in result.actions if getattr(a, "pod", None) is not None] == []
    assert result.delay == h.rec.poll_interval
    assert [await h.owner_of(p) for p in ("pod-0", "pod-1")] == [None, None]
    status = await h.status("b")
    assert status["replicas"]["draining"] == 0 and "startTime" not in status, status
    assert "UnitDraining" not in [e["reason"] for e in await h.kube.list_events(NS, "b")]
    # handed the peers, the younger one waits for the older
    result = await h.tick("b")
    assert h.condition(await h.status("b"), "Blocked")["status"] == "True"
