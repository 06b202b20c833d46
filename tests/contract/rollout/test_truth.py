"""Issue 11: "Verified" means this pod serves this version now, verified by this attempt.

Each test reproduces one finding of the issue against kmock with simulated agents that answer
like the real one (``tests/harness/fake_agent.py``): stale verdicts (1), a verified pod whose
engine restarted (2), booting pods (3), deletion that cannot release (4) or that leaves pods
drained (5), deadlines and halts (8).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import generate_latest
from weightroll_operator import control
from weightroll_operator.domain.model import UnitState
from weightroll_operator.errors import WeightrollError

from tests.contract.rollout.harness import NS, Harness

pytestmark = pytest.mark.asyncio


async def _verb(h: Harness, verb: control.Verb, name: str) -> control.Outcome:
    """What ``weightroll VERB NAME`` sends, sent the same way (one status merge patch)."""
    # stamped on the cluster clock, as the CLI stamps the API server's Date: the wall clock is
    # not the clock the operator and agents stamp on (the tier runs on virtual time)
    outcome = control.decide(verb, await h.wu(name), now=h.now())
    if outcome.status_patch is not None:
        await h.kube.patch_weightupdate_status(NS, name, outcome.status_patch)
    return outcome


def _serving(h: Harness, pods: list[str], version: str) -> bool:
    return all(h.agents[p].version == version and h.agents[p].ready for p in pods)


# ---- finding 1: stale verdicts ---------------------------------------------------------------


async def test_flipping_the_version_back_reloads_for_real(h: Harness) -> None:
    """v2 -> v1 -> v2: the second v2 is a new attempt, so the agent's old v2 record cannot pass
    for it; every pod really loads v2 again."""
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    for version in ("v1", "v2"):
        await h.patch_wu("wu", {"version": version, "source": {"uri": f"/weights/{version}"}})

        async def done(version: str = version) -> bool:
            status = await h.status("wu")
            return status.get("targetVersion") == version and status.get("phase") == "Succeeded"

        await h.run_until(["wu"], done)
    pods = ["pod-0", "pod-1"]
    assert _serving(h, pods, "v2"), [h.agents[p].snapshot() for p in pods]
    for pod in pods:
        assert h.agents[pod].runs == ["wu-v2-a1", "wu-v1-a2", "wu-v2-a3"]
    h.assert_never_ready_unverified({"v1", "v2"})


async def test_the_version_back_with_other_files_reloads_every_pod(h: Harness) -> None:
    """v2 from S1, then v3 from S2 (source and version change together: admitted), then v2
    from S2 before v3 started anywhere. Before: the agents' "v2" counted, so the fleet went
    Succeeded still serving S1 for the spec's S2. Now a verdict vouches for its files only."""
    await h.add_pods(2)
    await h.create_wu("wu", "v2", source={"uri": "/weights/v2-s1"}, strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    await h.patch_wu("wu", {"version": "v3", "source": {"uri": "/weights/v3-s2"}})
    await h.patch_wu("wu", {"version": "v2", "source": {"uri": "/weights/v2-s2"}})

    async def done() -> bool:
        status = await h.status("wu")
        fixed = all(h.agents[p].source == "/weights/v2-s2" for p in ("pod-0", "pod-1"))
        return fixed and status.get("phase") == "Succeeded"

    await h.run_until(["wu"], done)
    for pod in ("pod-0", "pod-1"):
        agent = h.agents[pod]
        assert (agent.version, agent.source) == ("v2", "/weights/v2-s2"), agent.snapshot()
        assert agent.runs == ["wu-v2-a1", "wu-v2-a2"], agent.runs
    h.assert_never_ready_unverified({"v2"})


async def test_a_second_weightupdate_at_the_same_version_from_other_files_reloads(
    h: Harness,
) -> None:
    await h.add_pods(2)
    await h.create_wu(
        "first", "v2", source={"uri": "/weights/v2-s1"}, strategy={"maxUnavailable": 2}
    )
    await h.run_until(["first"], h.phase_is("first", "Succeeded"))
    await h.rec.finalize(await h.wu("first"), await h.pods())
    await h.delete_wu("first")
    await h.create_wu(
        "fixed", "v2", source={"uri": "/weights/v2-s2"}, strategy={"maxUnavailable": 2}
    )
    await h.run_until(["fixed"], h.phase_is("fixed", "Succeeded"))
    for pod in ("pod-0", "pod-1"):
        assert h.agents[pod].source == "/weights/v2-s2", h.agents[pod].snapshot()


async def test_recreated_weightupdate_with_the_same_name_reloads(h: Harness) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    await h.rec.finalize(await h.wu("wu"), await h.pods())
    await h.delete_wu("wu")
    await h.create_wu("back", "v1", strategy={"maxUnavailable": 2})
    await h.run_until(["back"], h.phase_is("back", "Succeeded"))
    await h.rec.finalize(await h.wu("back"), await h.pods())
    await h.delete_wu("back")
    assert _serving(h, ["pod-0", "pod-1"], "v1")

    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})  # a new object, same name
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert _serving(h, ["pod-0", "pod-1"], "v2"), "Succeeded while the agents serve v1"
    for pod in ("pod-0", "pod-1"):
        assert h.agents[pod].runs == ["wu-v2-a1", "back-v1-a2", "wu-v2-a3"]
        assert len(set(h.agents[pod].executions)) == 3  # three distinct attempt ids
    h.assert_never_ready_unverified({"v1", "v2"})


async def test_rolling_back_twice_from_the_same_version_reloads(h: Harness) -> None:
    """v2 fails on pod-1 and rolls back to v1; v3 succeeds; v2 again fails and rolls back, now
    to v3: the second rollback of v2 is a new attempt, never the first one's old verdict."""
    await h.add_pods(2)
    h.agents["pod-1"].scripts["v2"] = "fail"
    strategy = {"maxUnavailable": 2, "onFailure": "Rollback", "maxFailedReplicas": 0}
    await h.create_wu("wu", "v2", strategy=strategy)
    await h.run_until(["wu"], h.phase_is("wu", "RolledBack"))
    assert _serving(h, ["pod-0", "pod-1"], "v1")
    for version in ("v3", "v2"):
        await h.patch_wu("wu", {"version": version, "source": {"uri": f"/weights/{version}"}})

        async def settled(version: str = version) -> bool:
            status = await h.status("wu")
            return status.get("targetVersion") == version and status.get("phase") in (
                "Succeeded",
                "RolledBack",
                "Failed",
            )

        await h.run_until(["wu"], settled)
    status = await h.status("wu")
    assert status["phase"] == "RolledBack", status
    assert _serving(h, ["pod-0", "pod-1"], "v3"), [h.agents[p].snapshot() for p in ("pod-0",)]
    assert h.agents["pod-1"].runs == [
        "wu-v2-a1",
        "wu-v1-a2-rb",
        "wu-v3-a3",
        "wu-v2-a4",
        "wu-v3-a5-rb",
    ]
    h.assert_never_ready_unverified({"v1", "v2", "v3"})


# ---- finding 2: truth after commit -----------------------------------------------------------


async def test_verified_pod_whose_engine_restarted_is_updated_again(h: Harness) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))

    # vLLM restarts under pod-0's agent: boot weights (v1) again, the agent holds the replica,
    # kubelet sees the container restart and the readiness probe fail
    h.agents["pod-0"].restart_engine()
    await h.emu.kubelet_update("pod-0", ready=False, restarted=True)
    await h.tick("wu")
    status = await h.status("wu")
    assert status["phase"] != "Succeeded" and status["replicas"]["verified"] == 1, status
    reason = next(p.get("reason") or "" for p in status["pods"] if p["name"] == "pod-0")
    assert reason.startswith("NotServing: verified at v2") and "serves v1" in reason, status
    text = generate_latest(h.metrics.registry).decode()
    assert 'weightroll_replicas{name="wu",namespace="default",state="verified"} 1.0' in text

    # the pod is pending again and a fresh attempt updates it; then kubelet sees it ready
    async def reloaded() -> bool:
        if h.agents["pod-0"].ready:
            await h.emu.kubelet_update("pod-0", ready=True)
        return (await h.status("wu")).get("replicas", {}).get("verified") == 2

    await h.run_until(["wu"], reloaded)
    assert h.agents["pod-0"].runs == ["wu-v2-a1", "wu-v2-a2"]
    assert _serving(h, ["pod-0", "pod-1"], "v2")
    st = await h.state_of("pod-0")
    assert st is not None and st.previous_version == "v1"  # what it served before the rollout
    h.assert_never_ready_unverified({"v2"})


async def test_a_restart_onto_boot_weights_with_the_verified_label_is_updated_again(
    h: Harness,
) -> None:
    """The boot weights carry the label (and the path) the pod was verified at: only the
    agent can tell, from its ranks, that the commit is gone; the pod is updated again."""
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))

    agent = h.agents["pod-0"]
    agent.boot_version, agent.boot_source = "v2", agent.source
    agent.restart_engine()
    await h.emu.kubelet_update("pod-0", ready=False, restarted=True)
    assert (agent.version, agent.commit_gone, agent.ready) == ("v2", True, False)
    await h.tick("wu")
    status = await h.status("wu")
    assert status["phase"] != "Succeeded" and status["replicas"]["verified"] == 1, status

    async def reloaded() -> bool:
        if h.agents["pod-0"].ready:
            await h.emu.kubelet_update("pod-0", ready=True)
        return (await h.status("wu")).get("replicas", {}).get("verified") == 2

    await h.run_until(["wu"], reloaded)
    assert h.agents["pod-0"].runs == ["wu-v2-a1", "wu-v2-a2"]
    assert _serving(h, ["pod-0", "pod-1"], "v2")
    h.assert_never_ready_unverified({"v2"})


# ---- finding 3: joining pods -----------------------------------------------------------------


async def test_booting_pod_is_claimed_only_once_its_agent_is_ready(h: Harness) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1, "updateTimeoutSeconds": 3})
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    [joining] = await h.add_pods(1, start=2)
    joining.booting()  # vLLM not up yet: the agent answers, version unknown
    booted_at = asyncio.get_running_loop().time() + 4  # boots for longer than the timeout
    while asyncio.get_running_loop().time() < booted_at:
        await h.tick("wu")
        await asyncio.sleep(0.1)
    assert await h.owner_of("pod-2") is None and joining.executions == []
    status = await h.status("wu")
    assert status["phase"] != "Failed", status
    note = next(p for p in status["pods"] if p["name"] == "pod-2")
    assert "Joining" in (note.get("reason") or ""), note

    joining.booted()
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert joining.runs == ["wu-v2-a1"] and joining.version == "v2"
    st = await h.state_of("pod-2")
    assert st is not None and st.previous_version == "v1"


# ---- findings 4 and 5: deletion --------------------------------------------------------------


async def test_deletion_keeps_the_finalizer_until_every_pod_is_released(h: Harness) -> None:
    await h.add_pods(2)
    h.agents["pod-0"].scripts["v2"] = "hang"
    h.agents["pod-1"].step = 0.2
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 2})

    async def both_running() -> bool:
        return all(h.agents[p].active is not None for p in ("pod-0", "pod-1"))

    await h.run_until(["wu"], both_running)
    while h.agents["pod-1"].active is not None:  # pod-1 commits; no pass has seen it yet
        await asyncio.sleep(0.02)
    await h.agents["pod-0"].disappear()  # unreachable: its update may still run
    with pytest.raises(WeightrollError, match="pod-0"):  # ReleaseIncomplete: kopf retries
        await h.rec.finalize(await h.wu("wu"), await h.pods())
    assert await h.owner_of("pod-0") == f"{NS}/wu"  # not released: nobody else may take it
    events = await h.kube.list_events(NS, "wu")
    assert any(e["reason"] == "ReleasePending" and "pod-0" in e["message"] for e in events)
    # pod-1's update committed (aborting it would answer 409): settled, traffic restored
    assert await h.owner_of("pod-1") is None
    assert await h.gate("pod-1") == "True" and h.agents["pod-1"].version == "v2"
    st1 = await h.state_of("pod-1")
    assert st1 is not None and st1.state is UnitState.VERIFIED

    await h.agents["pod-0"].appear()
    assert await h.rec.finalize(await h.wu("wu"), await h.pods()) == 1
    assert await h.owner_of("pod-0") is None
    assert await h.gate("pod-0") == "False"  # aborted, held by its agent: stays drained
    series = 'drained_since_timestamp_seconds{name="wu",namespace="default",pod="pod-0"}'
    assert series in generate_latest(h.metrics.registry).decode()
    # A restarted operator (an upgrade, a failover) rebuilds the series from the pod's own
    # record as kopf lists the pods: it lived only in the old process's memory.
    from weightroll_operator.metrics import Metrics

    h.metrics = Metrics()
    restarted = h.new_reconciler()
    for pod in await h.pods():
        restarted.note_left_drained(pod)
    assert series in generate_latest(h.metrics.registry).decode()
    restarted.note_left_drained(await h.pod("pod-0"), deleted=True)  # the pod is deleted
    assert series not in generate_latest(h.metrics.registry).decode()
    events = await h.kube.list_events(NS, "wu")
    reasons = {e["reason"]: e["message"] for e in events}
    assert "pod-0" in reasons["LeftDrained"], reasons
    h.assert_never_ready_unverified({"v2"})


async def test_deletion_restores_drained_pods_whose_agent_serves(h: Harness) -> None:
    """A pod drained by the deleted WeightUpdate whose update never ran (its agent refused the
    request) goes back into traffic; one whose update failed stays drained, alert kept."""
    await h.add_pods(3)
    h.agents["pod-0"].scripts["v2"] = "reject"
    h.agents["pod-1"].scripts["v2"] = "fail"
    h.agents["pod-2"].scripts["v2"] = "hang"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 3, "maxFailedReplicas": 3})

    async def settled() -> bool:
        st1 = await h.state_of("pod-1")
        return (
            await h.gate("pod-0") == "False"
            and st1 is not None
            and st1.state is UnitState.FAILED
            and h.agents["pod-2"].active is not None
        )

    await h.run_until(["wu"], settled)
    await h.rec.finalize(await h.wu("wu"), await h.pods())
    assert await h.gate("pod-0") == "True", "drained forever though its agent serves v1"
    st0 = await h.state_of("pod-0")
    assert st0 is not None and st0.state is UnitState.ROLLED_BACK and st0.version == "v1"
    for pod in ("pod-1", "pod-2"):
        assert await h.gate(pod) == "False"
    text = generate_latest(h.metrics.registry).decode()
    for pod in ("pod-1", "pod-2"):
        assert f'name="wu",namespace="default",pod="{pod}"' in text
    assert 'pod="pod-0"' not in text
    h.assert_never_ready_unverified({"v1", "v2"})


# ---- finding 8: deadlines and halts ----------------------------------------------------------


async def test_failed_canary_halts_whatever_max_failed_replicas_says(h: Harness) -> None:
    await h.add_pods(4)
    h.agents["pod-0"].scripts["v2"] = "fail"
    await h.create_wu(
        "wu", "v2", strategy={"maxUnavailable": 2, "canary": 1, "maxFailedReplicas": 3}
    )
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    for _ in range(3):
        await h.tick("wu")
    status = await h.status("wu")
    assert status["abortReason"] == "CanaryFailed", status
    for pod in ("pod-1", "pod-2", "pod-3"):
        assert h.agents[pod].executions == [] and await h.gate(pod) == "True"


async def test_retry_resumes_after_the_failure_budget_was_exceeded(h: Harness) -> None:
    await h.add_pods(3)
    h.agents["pod-1"].scripts["v2"] = "fail"
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    assert (await h.status("wu"))["abortReason"] == "FailureBudgetExceeded"

    h.agents["pod-1"].scripts["v2"] = "succeed"  # the bad copy was fixed
    outcome = await _verb(h, control.Verb.RETRY, "wu")
    assert outcome.status_patch is not None and outcome.status_patch["abortedAt"] is None
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    assert h.agents["pod-1"].runs == ["wu-v2-a1", "wu-v2-a2"]
    assert _serving(h, ["pod-0", "pod-1", "pod-2"], "v2")
    h.assert_never_ready_unverified({"v2"})


async def test_abort_halts_and_retry_resumes(h: Harness) -> None:
    await h.add_pods(4, step=0.05)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})

    async def one_verified() -> bool:
        return (await h.status("wu")).get("replicas", {}).get("verified", 0) >= 1

    await h.run_until(["wu"], one_verified)
    await _verb(h, control.Verb.ABORT, "wu")
    assert (await _verb(h, control.Verb.ABORT, "wu")).status_patch is None  # idempotent
    await h.run_until(["wu"], h.phase_is("wu", "Failed"))
    started = sum(len(a.executions) for a in h.agents.agents.values())
    for _ in range(3):
        await h.tick("wu")
    assert sum(len(a.executions) for a in h.agents.agents.values()) == started
    assert (await h.status("wu"))["abortReason"] == "AbortedByUser"
    await _verb(h, control.Verb.RETRY, "wu")
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    h.assert_never_ready_unverified({"v2"})


async def test_operator_downtime_does_not_count_against_the_progress_deadline(
    h: Harness,
) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1, "progressDeadlineSeconds": 60})
    await h.tick("wu")  # claims pod-0
    # the operator was down for an hour: its last recorded progress is old
    body: dict[str, Any] = await h.wu("wu")
    await h.kube.patch_weightupdate_status(NS, "wu", {"lastProgressTime": "2020-01-01T00:00:00Z"})
    assert body["status"]["phase"] == "Progressing"
    h.rec = h.new_reconciler()  # started now
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded", "Failed"))
    assert (await h.status("wu"))["phase"] == "Succeeded"


async def test_a_release_never_judges_a_pod_from_before_the_operator_s_own_last_write(
    h: Harness,
) -> None:
    """kopf runs the deletion handler beside the daemon's last pass, and the handler's pod list
    was read before it waited for the WeightUpdate's lock. A pod claimed by that pass looked
    unowned, the finalizer went, and the pod stayed drained and owned by a WeightUpdate that no
    longer existed, blocking every later one. Now the list is read under the lock (a callable),
    a view older than the operator's own last write is not judged, and a pass of a WeightUpdate
    being deleted does nothing."""
    from tests.harness.kube_fleet import make_pod

    await h.add_pods(0)  # the token Secret
    for i in range(2):  # with a resourceVersion, as the API server gives (writes conditional)
        agent = await h.agents.add(f"pod-{i}", i)
        pod = make_pod(f"pod-{i}", agent.host, h.agents.port)
        pod["metadata"]["resourceVersion"] = "1"
        await h.create_pod(pod)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 1})
    before = await h.pods()
    await h.tick("wu")  # claims and drains pod-0
    assert await h.owner_of("pod-0") == f"{NS}/wu"
    with pytest.raises(WeightrollError, match="pod-0: the pod index has not caught up"):
        await h.rec.finalize(await h.wu("wu"), before)
    assert await h.owner_of("pod-0") == f"{NS}/wu"

    body = await h.wu("wu")
    body["metadata"]["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    assert (await h.rec.reconcile(body, await h.pods())).actions == ()  # claims nothing more

    listed: list[Any] = []

    async def read_pods() -> None:
        listed.extend(await h.pods())

    await read_pods()
    await h.rec.finalize(body, lambda: listed)
    assert await h.owner_of("pod-0") is None and await h.owner_of("pod-1") is None


async def test_an_abort_that_loses_the_race_to_a_commit_fails_nothing(h: Harness) -> None:
    """Issue 27 item 4: at the unit timeout the operator aborts; when the agent committed first
    (the abort answers 409), the unit was failed anyway and the halt persisted, so under
    ``onFailure: Rollback`` a unit that succeeded rolled the fleet back. The verdict is the
    agent's: the committed unit is verified, nothing halts."""
    await h.add_pods(2)
    h.agents["pod-0"].scripts["v2"] = "race"
    await h.create_wu(
        "wu",
        "v2",
        strategy={"maxUnavailable": 1, "updateTimeoutSeconds": 60, "onFailure": "Rollback"},
    )

    async def loading() -> bool:
        return h.agents["pod-0"].active is not None

    await h.run_until(["wu"], loading)
    h.advance(61)  # past updateTimeoutSeconds: the operator aborts, the commit wins
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    status = await h.status("wu")
    assert status.get("abortedAt") is None, status
    assert status["replicas"]["failed"] == 0 and status["replicas"]["verified"] == 2, status
    assert all("-rb" not in run for a in h.agents.agents.values() for run in a.runs)
    h.assert_never_ready_unverified({"v2"})
