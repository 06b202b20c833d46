"""Events on pods against kmock: what ``kubectl describe pod`` shows of a rollout (issue 13 E).

Each updated pod gets, in order, ``WeightsDrained``, ``WeightsUpdating`` and ``WeightsVerified``
(naming the version); a pod whose update fails gets a Warning ``WeightsUpdateFailed`` with the
agents' reason and never ``WeightsVerified``. The Events name the pod by kind, namespace, name and
uid (``kubectl describe`` selects on all four). A repeat of the same Event raises its count.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from weightroll_operator.apply import ApplyContext, EventCounts, apply
from weightroll_operator.domain.actions import GateOff
from weightroll_operator.domain.fleet import pod_view
from weightroll_operator.domain.model import OwnerKey

from tests.contract.rollout.harness import NS, Harness

pytestmark = pytest.mark.asyncio


async def _pod_events(h: Harness, pod: str) -> list[dict[str, Any]]:
    events = [
        e for e in await h.kube.list_events(NS, pod) if e["involvedObject"].get("kind") == "Pod"
    ]
    return sorted(events, key=lambda e: (e["firstTimestamp"], e["metadata"]["name"]))


async def test_each_pod_tells_its_drain_update_and_verification(h: Harness) -> None:
    await h.add_pods(3)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    for i in range(3):
        name = f"pod-{i}"
        events = await _pod_events(h, name)
        assert [(e["reason"], e["type"], e["count"]) for e in events] == [
            ("WeightsDrained", "Normal", 1),
            ("WeightsUpdating", "Normal", 1),
            ("WeightsVerified", "Normal", 1),
        ], events
        for e in events:
            assert e["involvedObject"] == {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": NS,
                "name": name,
                "uid": f"uid-{name}",
            }
            assert e["source"] == {"component": "weightroll-operator"}
        drained, updating, verified = (e["message"] for e in events)
        assert drained == (
            "Draining for weights v2: WeightUpdate default/wu set "
            "weightroll.io/weights-ready=False, no new traffic"
        )
        # the attempt id: name, version, the WeightUpdate's uid, generation and attempt
        assert re.fullmatch(
            r"Started update wu-v2-[0-9a-f]{8}-g1-a1 to weights v2 \(full\) for WeightUpdate "
            r"default/wu",
            updating,
        ), updating
        assert verified == (
            "Verified weights v2 on every rank; traffic restored (weightroll.io/weights-ready=True)"
            " by WeightUpdate default/wu"
        )


async def test_a_failed_pod_says_why_and_is_never_verified(h: Harness) -> None:
    await h.add_pods(3)
    h.agents["pod-1"].scripts["v2"] = "fail"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    events = await _pod_events(h, "pod-1")
    assert [e["reason"] for e in events] == [
        "WeightsDrained",
        "WeightsUpdating",
        "WeightsUpdateFailed",
    ]
    failed = events[-1]
    assert failed["type"] == "Warning"
    assert "DigestMismatch: rank tp1 digest differs" in failed["message"]
    assert failed["message"].startswith("Update to weights v2 failed: UpdateFailed: ")
    assert failed["message"].endswith("; the pod stays drained (WeightUpdate default/wu)")
    # the halted rollout never touched pod-2
    assert await _pod_events(h, "pod-2") == []


async def test_a_repeated_event_raises_its_count(h: Harness) -> None:
    """The same GateOff applied in two passes: one Event, count 2, lastTimestamp moved on."""
    await h.add_pods(1)
    pod = pod_view(await h.pod("pod-0"), group_by=None)
    counts = EventCounts()
    start = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
    for minute in (0, 1):
        ctx = ApplyContext(
            kube=h.kube,
            agents=h.client,
            owner=OwnerKey(f"{NS}/wu"),
            namespace=NS,
            name="wu",
            uid=None,
            token=None,
            now=start + timedelta(minutes=minute),
            events=counts,
        )
        results = await apply([GateOff(pod, message="Draining for weights v2")], ctx)
        assert all(r.ok for r in results)
    events = await _pod_events(h, "pod-0")
    assert [(e["reason"], e["count"]) for e in events] == [("WeightsDrained", 2)]
    assert events[0]["firstTimestamp"] == "2026-12-01T08:00:00Z"
    assert events[0]["lastTimestamp"] == "2026-12-01T08:01:00Z"
