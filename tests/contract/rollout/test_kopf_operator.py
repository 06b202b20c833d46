"""The whole operator (kopf handlers, indices, timer) against kmock and simulated agents."""

from __future__ import annotations

import pytest

from tests.contract.rollout.harness import NS, Harness, running_operator, wait_until

pytestmark = pytest.mark.asyncio


async def test_operator_rolls_out_8_pods(h: Harness) -> None:
    await h.add_pods(8)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 3})

    async with running_operator(h):
        await wait_until(h.phase_is("wu", "Succeeded"), timeout=30)
        status = await h.status("wu")
        gates = [await h.gate(f"pod-{i}") for i in range(8)]
        annotations = (await h.wu("wu"))["metadata"].get("annotations", {})
        events = {e["reason"] for e in await h.kube.list_events(NS, "wu")}

    assert status["replicas"]["verified"] == 8
    assert gates == ["True"] * 8
    for i in range(8):
        assert h.agents[f"pod-{i}"].runs == ["wu-v2-a1"]
    h.assert_never_ready_unverified({"v2"})
    assert h.max_drained_at_once() <= 3
    # kopf keeps its progress under our prefix, never under kopf.zalando.org
    assert not any(k.startswith("kopf.zalando.org") for k in annotations)
    assert all("<" not in k for k in annotations), annotations  # valid annotation keys
    assert {"UnitDraining", "UnitVerified", "PhaseChanged"} <= events
