"""The operator's reconciler against kmock with simulated agents (issue 4 acceptance 2).

Each test asserts the WeightUpdate status, the pods' conditions and, from the log of every
``pods/status`` write, that no unverified pod was ever marked ready.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from weightroll_operator.domain.model import LABEL_WEIGHT_VERSION, UnitState
from weightroll_operator.errors import InvalidSpec

from tests.contract.rollout.harness import NS, Harness

pytestmark = pytest.mark.asyncio


async def test_full_rollout_of_8_pods(h: Harness) -> None:
    await h.add_pods(8)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))

    status = await h.status("wu")
    assert status["replicas"] == {
        "total": 8,
        "updated": 8,
        "verified": 8,
        "draining": 0,
        "failed": 0,
        "stale": 0,
    }
    assert h.condition(status, "Verified")["status"] == "True"
    assert h.condition(status, "Progressing")["reason"] == "RolloutComplete"
    assert status["stableVersion"] == "v2" and status["completionTime"]
    for i in range(8):
        pod = await h.pod(f"pod-{i}")
        assert await h.gate(f"pod-{i}") == "True"
        assert pod["metadata"]["labels"][LABEL_WEIGHT_VERSION] == "v2"
        assert await h.owner_of(f"pod-{i}") is None
        st = await h.state_of(f"pod-{i}")
        assert st is not None and st.state is UnitState.VERIFIED and st.previous_version == "v1"
        assert h.agents[f"pod-{i}"].runs == ["wu-v2-a1"]
    h.assert_never_ready_unverified({"v2"})
    assert h.max_drained_at_once() <= 2
    updates = h.metrics.updates_total.labels(NS, "wu", "succeeded")._value.get()
    assert updates == 1
    # 2 pod-status + 2 pod-metadata writes per pod, 2 Events per pod on the WeightUpdate and 3
    # on the pod itself (drained, updating, verified), amortised status writes
    per_pod = (h.kube.writes["pod-status"] + h.kube.writes["pod-metadata"]) / 8
    assert per_pod == 4
    assert sum(h.kube.writes.values()) / 8 <= 11


async def test_idle_pass_writes_nothing(h: Harness) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    before = sum(h.kube.writes.values())
    result = await h.tick("wu")
    assert not result.status_written and result.actions == ()
    assert sum(h.kube.writes.values()) == before


async def test_failing_pod_halts(h: Harness) -> None:
    await h.add_pods(6)
    h.agents["pod-2"].scripts["v2"] = "fail"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    for _ in range(5):  # halted: further passes start nothing
        await h.tick("wu")

    status = await h.status("wu")
    assert status["abortReason"] == "FailureBudgetExceeded"
    assert h.condition(status, "Degraded")["status"] == "True"
    assert "DigestMismatch" in h.condition(status, "Degraded")["message"]
    failed = [p for p in status["pods"] if p["state"] == "Failed"]
    assert [p["name"] for p in failed] == ["pod-2"] and "DigestMismatch" in failed[0]["reason"]
    # the failed pod stays drained and owned; pods after it were never touched
    assert await h.gate("pod-2") == "False"
    assert await h.owner_of("pod-2") == f"{NS}/wu"
    for i in (0, 1):
        assert await h.gate(f"pod-{i}") == "True"
    for i in (3, 4, 5):
        assert await h.gate(f"pod-{i}") == "True"
        assert h.agents[f"pod-{i}"].executions == []
    assert status["replicas"]["failed"] == 1 and status["replicas"]["stale"] == 3
    h.assert_never_ready_unverified({"v2"})
    assert h.metrics.updates_total.labels(NS, "wu", "failed")._value.get() == 1


async def test_failing_pod_rolls_back(h: Harness) -> None:
    await h.add_pods(6)
    h.agents["pod-2"].scripts["v2"] = "fail"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1, "onFailure": "Rollback"})
    await h.run_until(["wu"], h.phase_is("wu", "RolledBack"))

    status = await h.status("wu")
    assert status["phase"] == "RolledBack"
    assert h.condition(status, "Progressing")["reason"] == "RolledBack"
    for i in range(6):
        agent = h.agents[f"pod-{i}"]
        assert agent.version == "v1" and agent.ready, (i, agent.snapshot())
        assert await h.gate(f"pod-{i}") == "True"
        assert await h.owner_of(f"pod-{i}") is None
    # touched pods were reloaded in place to their recorded previous weights
    assert h.agents["pod-0"].runs == ["wu-v2-a1", "wu-v1-a2-rb"]
    assert h.agents["pod-2"].runs == ["wu-v2-a1", "wu-v1-a2-rb"]
    assert h.agents["pod-4"].executions == []
    h.assert_never_ready_unverified({"v1", "v2"})
    assert h.metrics.updates_total.labels(NS, "wu", "rolled_back")._value.get() == 1
    # pod-2 never served v2: its only True write happened after the rollback to v1
    assert [
        w.agent["version"]
        for w in h.emu.status_writes  # type: ignore[index]
        if w.pod == "pod-2" and w.gate() == "True"
    ] == ["v1"]


async def test_pause_and_resume(h: Harness) -> None:
    await h.add_pods(6, step=0.01)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})

    async def two_verified() -> bool:
        return (await h.status("wu")).get("replicas", {}).get("verified", 0) >= 2

    await h.run_until(["wu"], two_verified)
    await h.patch_wu("wu", {"paused": True})
    await h.run_until(["wu"], h.phase_is("wu", "Paused"))
    held = sum(len(a.executions) for a in h.agents.agents.values())
    for _ in range(5):
        await h.tick("wu")
    assert sum(len(a.executions) for a in h.agents.agents.values()) == held
    status = await h.status("wu")
    assert h.condition(status, "Paused")["status"] == "True"
    assert status["replicas"]["draining"] == 0
    assert status["replicas"]["stale"] == 6 - status["replicas"]["verified"]

    await h.patch_wu("wu", {"paused": False})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert h.condition(await h.status("wu"), "Paused")["status"] == "False"
    h.assert_never_ready_unverified({"v2"})


async def test_canary_pauses_until_promoted(h: Harness) -> None:
    await h.add_pods(4)
    await h.create_wu(
        "wu", "v2", strategy={"maxUnavailable": 2, "canary": 1, "pauseAfterCanary": True}
    )
    await h.run_until(["wu"], h.phase_is("wu", "Paused"))
    status = await h.status("wu")
    assert status["replicas"]["verified"] == 1
    assert h.condition(status, "Paused")["reason"] == "CanaryComplete"
    await h.patch_wu("wu", {"strategy": {"pauseAfterCanary": False}})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    h.assert_never_ready_unverified({"v2"})


async def test_operator_restart_mid_rollout(h: Harness) -> None:
    await h.add_pods(8, step=0.05)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 3})

    async def some_in_flight() -> bool:
        running = [a for a in h.agents.agents.values() if a.active is not None]
        return len(running) >= 2

    await h.run_until(["wu"], some_in_flight)
    # a new operator process: no memory, new clients; it resumes from annotations + agents
    await h.client.close()
    h.rec = h.new_reconciler()
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))

    for i in range(8):
        assert h.agents[f"pod-{i}"].runs == ["wu-v2-a1"], "a unit was updated twice"
        assert await h.gate(f"pod-{i}") == "True"
    h.assert_never_ready_unverified({"v2"})
    assert h.max_drained_at_once() <= 3


async def test_restart_between_claim_and_gate(h: Harness) -> None:
    """A crash after the annotation write but before the gate write: the gate is written on
    resume and the update starts only after the drain is observed."""
    await h.add_pods(1)
    await h.create_wu("wu", "v2")
    result = await h.tick("wu")
    assert [type(a).__name__ for a in result.actions][:2] == ["Claim", "GateOff"]
    # simulate the lost gate write: put the gate back to True (as if never written)
    h.emu.status_writes.clear()
    await h.kube.patch_pod_condition(
        NS, "pod-0", {"type": "weightroll.io/weights-ready", "status": "True"}
    )
    h.emu.status_writes.clear()
    h.rec = h.new_reconciler()
    result = await h.tick("wu")
    assert [type(a).__name__ for a in result.actions] == ["GateOff"]
    assert h.agents["pod-0"].executions == []
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert h.agents["pod-0"].runs == ["wu-v2-a1"]
    h.assert_never_ready_unverified({"v2"})


async def test_pod_deleted_mid_update(h: Harness) -> None:
    await h.add_pods(4)
    h.agents["pod-1"].scripts["v2"] = "hang"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})

    async def pod1_loading() -> bool:
        return h.agents["pod-1"].active is not None

    await h.run_until(["wu"], pod1_loading)
    await h.delete_pod("pod-1")
    await h.agents["pod-1"].disappear()
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    status = await h.status("wu")
    assert status["replicas"]["total"] == 3 and status["replicas"]["verified"] == 3
    h.assert_never_ready_unverified({"v2"})


async def test_hanging_agent_times_out_and_disappearing_agent_fails(h: Harness) -> None:
    await h.add_pods(3)
    h.agents["pod-0"].scripts["v2"] = "hang"
    h.agents["pod-1"].scripts["v2"] = "hang"  # in flight until the agent vanishes
    await h.create_wu(
        "wu",
        "v2",
        strategy={"maxUnavailable": 2, "updateTimeoutSeconds": 60, "maxFailedReplicas": 5},
    )

    async def both_in_flight() -> bool:
        return all(h.agents[pod].active is not None for pod in ("pod-0", "pod-1"))

    await h.run_until(["wu"], both_in_flight)
    await h.agents["pod-1"].disappear()  # the agent vanishes mid-update
    for _ in range(3):  # an unreachable agent is no verdict: the unit waits for its deadline
        await h.tick("wu")
    status = await h.status("wu")
    assert status["phase"] == "Progressing" and status["replicas"]["failed"] == 0, status
    h.advance(61)  # past updateTimeoutSeconds, on the operator's clock

    async def both_failed() -> bool:
        return (await h.status("wu")).get("replicas", {}).get("failed") == 2

    await h.run_until(["wu"], both_failed)
    status = await h.status("wu")
    reasons = {p["name"]: p["reason"] for p in status["pods"] if p["state"] == "Failed"}
    assert "UpdateTimeout" in reasons["pod-0"] and "UpdateTimeout" in reasons["pod-1"]
    assert h.agents["pod-0"].update_of("wu-v2-a1").phase.value == "Aborted"
    for pod in ("pod-0", "pod-1"):
        assert await h.gate(pod) == "False"
    h.assert_never_ready_unverified({"v2"})


async def test_two_weightupdates_on_one_fleet(h: Harness) -> None:
    await h.add_pods(4, step=0.03)
    await h.create_wu("a", "v2", strategy={"maxUnavailable": 1})

    async def a_in_flight() -> bool:
        return any(ag.active for ag in h.agents.agents.values())

    await h.run_until(["a"], a_in_flight)
    await h.create_wu("b", "v3", strategy={"maxUnavailable": 4})
    await h.tick("b")
    status_b = await h.status("b")
    blocked = h.condition(status_b, "Blocked")
    assert blocked["status"] == "True" and f"{NS}/a" in blocked["message"]
    assert status_b["phase"] == "Pending"

    await h.run_until(["a", "b"], h.phase_is("b", "Succeeded"), timeout=20)
    for i in range(4):
        assert h.agents[f"pod-{i}"].version == "v3"
        # attempts are counted per pod, across WeightUpdates: b's claim is the pod's second
        assert h.agents[f"pod-{i}"].runs == ["a-v2-a1", "b-v3-a2"]
    # a pod was never owned by both: ownership always passed through "unowned"
    owners = [
        (r.name, ((r.data or {}).get("metadata") or {}).get("annotations", {}))
        for r in h.emu
        if r.resource is not None
        and r.resource.plural == "pods"
        and r.method == "PATCH"
        and r.subresource is None
    ]
    last: dict[str, str | None] = {}
    for pod, ann in owners:
        if "weightroll.io/owner" in ann:
            new = ann["weightroll.io/owner"]
            assert new is None or last.get(pod) in (None, new), (pod, last.get(pod), new)
            last[pod] = new
    # a is left alone afterwards: its pods are superseded, counted stale, never re-driven
    await h.tick("a")
    status_a = await h.status("a")
    assert status_a["phase"] == "Succeeded" and status_a["replicas"]["stale"] == 4
    h.assert_never_ready_unverified({"v2", "v3"})


async def test_invalid_spec_is_reported(h: Harness) -> None:
    await h.add_pods(1)
    await h.create_wu("wu", "v2", source={"uri": "/w", "mode": "sparse"})
    with pytest.raises(InvalidSpec, match="baseVersion"):
        await h.tick("wu")
    status = await h.status("wu")
    assert status["phase"] == "Failed"
    cond = h.condition(status, "InvalidSpec")
    assert cond["status"] == "True" and "spec.source.baseVersion" in cond["message"]
    await h.create_wu("wu2", "v2", source={"uri": "s3://bucket/w"})
    with pytest.raises(InvalidSpec, match=r"spec\.source"):
        await h.tick("wu2")
    assert h.agents["pod-0"].executions == []


async def test_invalid_spec_sets_the_failed_phase_metric(h: Harness) -> None:
    """Issue 27 item 12: an invalid spec wrote phase Failed to the status but never to the
    phase gauge, so the WeightrollUpdateFailed alert (``weightroll_update_phase{phase="Failed"}``)
    stayed silent."""
    await h.add_pods(1)
    await h.create_wu("wu", "v2", source={"uri": "/w", "mode": "sparse"})
    with pytest.raises(InvalidSpec):
        await h.tick("wu")
    text = generate_latest(h.metrics.registry).decode()
    assert 'weightroll_update_phase{name="wu",namespace="default",phase="Failed"} 1.0' in text, text


async def test_deletion_aborts_in_flight_and_releases(h: Harness) -> None:
    await h.add_pods(2)
    h.agents["pod-0"].scripts["v2"] = "hang"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})

    async def loading() -> bool:
        return h.agents["pod-0"].active is not None

    await h.run_until(["wu"], loading)
    assert 'name="wu"' in generate_latest(h.metrics.registry).decode()
    released = await h.rec.finalize(await h.wu("wu"), await h.pods())
    assert released == 2
    # only the drained series of the pod left drained stays exported (its alert keeps firing);
    # every other series of the deleted WeightUpdate is gone
    exported = [
        line
        for line in generate_latest(h.metrics.registry).decode().splitlines()
        if 'name="wu"' in line and not line.startswith("#")
    ]
    drained = {p for p in ("pod-0", "pod-1") if await h.gate(p) == "False"}
    assert "pod-0" in drained
    series = 'weightroll_replica_drained_since_timestamp_seconds{name="wu",namespace="default",'
    assert sorted(exported) == sorted(
        line for line in exported if any(line.startswith(f'{series}pod="{p}"}}') for p in drained)
    ) and len(exported) == len(drained), exported
    assert h.agents["pod-0"].update_of("wu-v2-a1").phase.value == "Aborted"
    assert await h.owner_of("pod-0") is None
    assert await h.gate("pod-0") == "False"  # stays drained
    st = await h.state_of("pod-0")
    assert st is not None and st.state is UnitState.FAILED and "LeftDrained" in st.reason
    h.assert_never_ready_unverified({"v2"})


async def test_wrong_token_is_reported_and_nothing_drains(h: Harness) -> None:
    await h.add_pods(1)
    h.agents["pod-0"].token = "other"
    await h.create_wu("wu", "v2")
    for _ in range(3):
        await h.tick("wu")
    status = await h.status("wu")
    assert status["phase"] == "Pending" and status["replicas"]["stale"] == 1
    assert "401" in status["pods"][0]["reason"]
    assert await h.gate("pod-0") == "True"  # never drained: the agent's version is unknown
    assert h.agents["pod-0"].executions == []
    assert h.metrics.agent_unreachable.labels(NS, "wu", "pod-0")._value.get() == 1


async def test_status_view_reads_the_cluster(h: Harness) -> None:
    from weightroll_operator.k8s.client import KubeApi, KubeConfig
    from weightroll_operator.status_view import _fetch, render

    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    body, events = await _fetch(KubeApi(KubeConfig(server=h.url)), NS, "wu")
    text = render(body, events)
    assert "Phase:     Succeeded" in text
    assert "pod-0  Verified  v2" in text
    assert "UnitVerified" in text and "PhaseChanged" in text


async def test_succeeded_rollout_converges_new_pods(h: Harness) -> None:
    await h.add_pods(3)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    # scale-up: a new pod booted with the old weights, one booted with the new ones; neither
    # has the gate condition yet, so both are NotReady
    await h.add_pods(1, start=3, gate=None)
    await h.add_pods(1, start=4, gate=None, version="v2", source="/weights/v2")

    async def all_verified() -> bool:
        return (await h.status("wu")).get("replicas", {}).get("verified") == 5

    await h.run_until(["wu"], all_verified)
    assert (await h.status("wu"))["phase"] == "Succeeded"
    assert h.agents["pod-3"].runs == ["wu-v2-a1"]
    assert h.agents["pod-4"].executions == []  # already serving v2: only the gate was set
    assert h.metrics.updates_total.labels(NS, "wu", "succeeded")._value.get() == 1
    assert await h.gate("pod-3") == "True" and await h.gate("pod-4") == "True"
    h.assert_never_ready_unverified({"v2"})


async def test_progress_deadline_fails_the_rollout(h: Harness) -> None:
    await h.add_pods(2)
    h.agents["pod-0"].scripts["v2"] = "hang"
    await h.create_wu(
        "wu",
        "v2",
        strategy={"maxUnavailable": 1, "progressDeadlineSeconds": 60, "updateTimeoutSeconds": 600},
    )

    async def pod0_in_flight() -> bool:
        return h.agents["pod-0"].active is not None

    await h.run_until(["wu"], pod0_in_flight)
    h.advance(61)  # no progress for progressDeadlineSeconds, on the operator's clock
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    status = await h.status("wu")
    progressing = h.condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert await h.gate("pod-0") == "False"  # the hanging unit stays drained
    assert h.agents["pod-1"].executions == []
    h.assert_never_ready_unverified({"v2"})


async def test_agent_refusing_the_update_is_reported(h: Harness) -> None:
    await h.add_pods(1)
    h.agents["pod-0"].scripts["v2"] = "reject"
    await h.create_wu("wu", "v2", strategy={"updateTimeoutSeconds": 60})
    for _ in range(3):
        await h.tick("wu")
    pods = (await h.status("wu"))["pods"]
    assert "StartUpdateFailed" in pods[0]["reason"] and "422" in pods[0]["reason"]
    h.advance(61)  # the refusal is retried until updateTimeoutSeconds, then the unit fails
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    assert await h.gate("pod-0") == "False"
    h.assert_never_ready_unverified({"v2"})


async def test_a_selector_naming_the_traffic_label_keeps_its_claimed_pods(h: Harness) -> None:
    """Found after issue 11 was built: the claim removes ``trafficLabel``, and a selector copied
    from the Service names it, so a claimed pod stopped matching and left the fleet, drained,
    with no step, no budget and no drained series; the next unit went the same way until the
    whole fleet was out of traffic. A pod the WeightUpdate owns stays in its fleet."""
    from tests.harness.kube_fleet import make_pod

    await h.add_pods(0)  # the token Secret
    for i in range(4):
        agent = await h.agents.add(f"pod-{i}", i)
        labels = {"app": "llm", "serving": "true"}
        await h.create_pod(make_pod(f"pod-{i}", agent.host, h.agents.port, labels=labels))
    await h.create_wu(
        "wu",
        "v2",
        selector={"matchLabels": {"app": "llm", "serving": "true"}},
        strategy={"maxUnavailable": 1, "trafficLabel": "serving"},
    )
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    for i in range(4):
        pod = await h.pod(f"pod-{i}")
        assert pod["metadata"]["labels"]["serving"] == "true"
        assert await h.gate(f"pod-{i}") == "True"
        assert h.agents[f"pod-{i}"].version == "v2"
    h.assert_never_ready_unverified({"v2"})
    assert h.max_drained_at_once() <= 1
