"""Holes found by the session-7 review, reproduced against kmock with agents that answer like
the real one: a claim made on a cached agent answer (issue 11, D), and a deletion held by a
token Secret deleted with its WeightUpdate (E). Each failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.rollout.harness import Harness

pytestmark = pytest.mark.asyncio


async def test_a_claim_records_what_the_pod_serves_now_not_a_cached_answer(h: Harness) -> None:
    """``/v1/state`` answers of pods in traffic are cached (30 s by default). A trainer push
    that committed ``step-7`` on pod-1 since its cached answer changes nothing on the pod, so
    only a fresh answer can tell the claim what pod-1 serves (its rollback target)."""
    await h.add_pods(2)
    rec = h.new_reconciler(state_ttl=30.0)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.tick("wu", rec)  # pod-0 claimed; pod-1's v1 answer cached
    assert (await h.state_of("pod-1")) is None
    pushed = h.agents["pod-1"]
    pushed.version = pushed.committed_version = "step-7"
    pushed.source = "/weights/step-7"
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"), rec=rec)
    st = await h.state_of("pod-1")
    assert st is not None
    assert (st.previous_version, st.previous_source and st.previous_source.uri) == (
        "step-7",
        "/weights/step-7",
    ), "the claim recorded a cached answer as the pod's previous weights"


async def test_deleting_a_weightupdate_whose_token_secret_is_gone_finishes(h: Harness) -> None:
    """Nothing left to release: the finalizer goes even though the Secret is gone (deleted in
    the same ``kubectl delete -f``, or with its namespace)."""
    await h.add_pods(1)
    await h.create_wu("wu", "v2", agent={"tokenSecretRef": {"name": "missing"}})
    assert await h.rec.finalize(await h.wu("wu"), await h.pods()) == 0


async def test_a_claim_on_a_cached_answer_confirmed_fresh_is_planned_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The claim pass asks pod-1's agent afresh; its answer is the cached one, so the plan made
    on it is applied as it is (the unconfirmed case is the test above): planned once, pod-1
    claimed with what it serves."""
    import weightroll_operator.reconcile as reconcile

    await h.add_pods(2)
    rec = h.new_reconciler(state_ttl=30.0)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.tick("wu", rec)  # pod-0 claimed; pod-1's v1 answer cached
    await h.run_until(["wu"], lambda: _verified(h, "pod-0"), rec=rec)
    plans: list[object] = []
    real = reconcile.plan

    def counting(*args: object, **kw: object) -> object:
        plans.append(kw)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(reconcile, "plan", counting)
    log = h.agents["pod-1"].request_log = tmp_path / "pod-1.log"
    for _ in range(100):
        plans.clear()
        await h.tick("wu", rec)
        if await h.state_of("pod-1") is not None:
            break
    assert len(plans) == 1, plans  # claimed in the pass that planned it, on a fresh answer
    st = await h.state_of("pod-1")
    assert st is not None and st.previous_version == "v1"
    assert "GET /v1/state" in log.read_text().splitlines()  # asked afresh for the claim


async def _verified(h: Harness, pod: str) -> bool:
    st = await h.state_of(pod)
    return st is not None and st.state.value == "Verified"


async def test_a_claim_whose_cached_answer_changed_is_dropped_and_not_reported(
    h: Harness,
) -> None:
    """The claim pass plans pod-1's claim on its cached ``v1`` answer; asked afresh, the agent
    says ``step-7`` (a trainer push meanwhile). The claim is dropped from the pass, as a write
    on a stale ``resourceVersion`` is: no write, no Event, the status does not count pod-1 in
    flight, and the next pass runs at once and claims it on the fresh answer."""
    await h.add_pods(2)
    rec = h.new_reconciler(state_ttl=30.0)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.tick("wu", rec)  # pod-0 claimed; pod-1's v1 answer cached
    await h.run_until(["wu"], lambda: _verified(h, "pod-0"), rec=rec)
    pushed = h.agents["pod-1"]
    pushed.version = pushed.committed_version = "step-7"
    pushed.source = "/weights/step-7"
    result = await h.tick("wu", rec)
    assert not [a for a in result.actions if getattr(a, "pod", None) is not None]
    assert result.delay == 0.0  # the next pass at once, on the fresh answer
    assert await h.state_of("pod-1") is None and await h.gate("pod-1") == "True"
    status = await h.status("wu")
    assert status["replicas"]["draining"] == 0, status["replicas"]
    assert {"name": "pod-1", "state": "Pending"} in status["pods"], status["pods"]
    assert "0 units in flight" in h.condition(status, "Progressing")["message"]
    events = [e["reason"] for e in await h.kube.list_events("default", "wu")]
    assert "UnitDraining" not in events[1:], events
    result = await h.tick("wu", rec)
    st = await h.state_of("pod-1")
    assert st is not None and st.previous_version == "step-7"
