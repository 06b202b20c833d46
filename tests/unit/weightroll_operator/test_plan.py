"""Table-driven tests of the pure planner (issue 4 acceptance 1)."""

from __future__ import annotations

import dataclasses

import pytest
from weightroll_operator.api.v1alpha1 import (
    Condition,
    ConditionStatus,
    ConditionType,
    Phase,
    WeightUpdateStatus,
)
from weightroll_operator.domain.actions import (
    AbortUpdate,
    Claim,
    Emit,
    GateOff,
    GateOn,
    Settle,
    StartUpdate,
)
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.model import AgentView, UnitState
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    PodClass,
    Premise,
    aggregate_emits,
    emit_holding,
    plan,
    queries,
    unsettled,
)

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import (
    ME,
    NOW,
    OTHER,
    V1_SRC,
    V2_SRC,
    agent,
    pod,
    run,
    spec,
    state,
    summary,
)

FRESH = {f"p{i}": agent("v1") for i in range(10)}


#: The agent of a pod verified at v2 by ``wu-v2`` (the builders' attempt id), still saying so.
SERVING_V2 = agent("v2", committed_update_id="wu-v2")


def claimed(p: object) -> list[str]:
    return [a.pod.name for a in p.actions if isinstance(a, Claim)]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# batching and maxUnavailable
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_unavailable", "not_ready", "expected"),
    [
        (1, set(), ["p0"]),
        (2, set(), ["p0", "p1"]),
        ("40%", set(), ["p0", "p1"]),
        ("100%", set(), ["p0", "p1", "p2", "p3", "p4"]),
        ("1%", set(), ["p0"]),  # rounds down, but at least one
        # a NotReady pod counts against the budget, and goes first (it is down anyway)
        (2, {"p3"}, ["p3", "p0"]),
        # more NotReady pods than the budget: claiming one keeps it out for the whole reload,
        # so each claim takes a slot (issue 27 item 2: they were all claimed, for free)
        (1, {"p2", "p4"}, ["p2"]),
    ],
)
def test_batching_respects_max_unavailable(
    max_unavailable: int | str, not_ready: set[str], expected: list[str]
) -> None:
    pods = [pod(f"p{i}", ready=f"p{i}" not in not_ready) for i in range(5)]
    p = run(spec(maxUnavailable=max_unavailable), pods, FRESH)
    assert claimed(p) == expected
    # every claim is followed by the gate write for the same pod
    names = [(t, n) for t, n in summary(p) if t in ("Claim", "GateOff")]
    assert names == [x for n in expected for x in (("Claim", n), ("GateOff", n))]


@pytest.mark.parametrize(
    ("p2_agent", "expected"),
    [
        # p2's agent holds it out until an update (vLLM restarted under it): free, like a pod
        # our gate holds, so it is converged though the failed p0 holds the only slot
        (agent("v1", ready=False), ["p2"]),
        # a readiness blip (the agent ready): it comes back by itself, a claim costs a slot
        (agent("v1"), []),
        # booting (ranks not up), or running an update: it may come back by itself
        (agent("v1", ready=False, engine_seen=False), []),
        (agent("v1", ready=False, active_update_id="someone-else"), []),
    ],
)
def test_a_unit_its_agent_holds_out_costs_no_slot(p2_agent: AgentView, expected: list[str]) -> None:
    """Found by the simulation tier: with budget 1 held by a failed unit, a pod whose vLLM
    restarted (its agent holding it out until a full update) was never converged."""
    failed = state(UnitState.FAILED, reason="UpdateFailed: x")
    pods = [
        pod("p0", gate=False, ready=False, st=failed, owner=ME),
        pod("p1", st=state(UnitState.VERIFIED)),
        pod("p2", ready=False, st=state(UnitState.VERIFIED)),
    ]
    agents = {"p0": agent("v1", ready=False), "p1": SERVING_V2, "p2": p2_agent}
    p = run(spec(maxUnavailable=1), pods, agents, DONE)
    assert claimed(p) == expected


@pytest.mark.parametrize("phase", [p for p in UpdatePhase if not p.terminal])
def test_in_flight_units_use_the_budget(phase: UpdatePhase) -> None:
    """Every agent phase before the verdict is in flight, the prefetch phases included."""
    pods = [pod("p0", gate=False, ready=False, st=state()), pod("p1"), pod("p2")]
    p = run(spec(maxUnavailable=2), pods, {**FRESH, "p0": agent(phase=phase)})
    assert claimed(p) == ["p1"]


def test_claim_records_previous_version_and_source() -> None:
    p = run(spec(), [pod("p0")], {"p0": agent("v1", source=V1_SRC)})
    claim = p.actions[0]
    assert isinstance(claim, Claim)
    assert claim.owner == ME
    assert claim.state.state is UnitState.DRAINING
    assert (claim.state.previous_version, claim.state.previous_source) == ("v1", V1_SRC)
    assert (claim.state.update_id, claim.state.attempt) == ("wu-v2-g0-a1", 1)
    assert claim.state.started_at == timestamp(NOW)


def test_traffic_label_is_removed_and_remembered() -> None:
    pods = [pod("p0", labels={"app": "llm", "serving": "yes"})]
    p = run(spec(trafficLabel="serving"), pods, FRESH)
    claim = p.actions[0]
    assert isinstance(claim, Claim)
    assert claim.remove_label == "serving"
    assert claim.state.traffic_label_value == "yes"


# --------------------------------------------------------------------------------------------
# one unit's steps
# --------------------------------------------------------------------------------------------

DRAINING = state()


@pytest.mark.parametrize(
    ("gate", "ready", "agent_view", "expected"),
    [
        # gate write lost (restart between Claim and GateOff): write it again
        (True, True, agent(), [("GateOff", "p0")]),
        # gate False but the pod is still Ready: wait, never start the reload
        (False, True, agent(), []),
        # drained and observed NotReady, agent never heard of the update: start it
        (False, False, agent(), [("StartUpdate", "p0")]),
        # agent busy with it
        (False, False, agent(phase=UpdatePhase.LOADING), []),
        # agent unreachable: wait (until the unit times out)
        (False, False, agent(reachable=False), []),
        # committed at the version: gate on, then settle, then the event
        (
            False,
            False,
            agent("v2", phase=UpdatePhase.COMMITTED),
            [("GateOn", "p0"), ("Settle", "p0"), ("Emit", Reason.UNIT_VERIFIED)],
        ),
        # failed verdict: settle failed, stays drained, never GateOn
        (
            False,
            False,
            agent(phase=UpdatePhase.FAILED, reasons=["digest mismatch"]),
            [("Settle", "p0"), ("Emit", Reason.UNIT_FAILED), ("Emit", "FailureBudgetExceeded")],
        ),
        # committed, but at another version: failed, never GateOn
        (
            False,
            False,
            agent(phase=UpdatePhase.COMMITTED, update_version="v9"),
            [("Settle", "p0"), ("Emit", Reason.UNIT_FAILED), ("Emit", "FailureBudgetExceeded")],
        ),
    ],
)
def test_unit_steps(
    gate: bool, ready: bool, agent_view: object, expected: list[tuple[str, str]]
) -> None:
    pods = [pod("p0", gate=gate, ready=ready, st=DRAINING)]
    p = run(spec(), pods, {"p0": agent_view})  # type: ignore[dict-item]
    assert summary(p) == expected
    for a in p.actions:
        if isinstance(a, StartUpdate):
            assert a.request.id == "wu-v2"
            assert a.request.version == "v2"
            assert a.request.source.uri == "/weights/v2"
        if isinstance(a, Settle) and a.state.state is UnitState.FAILED:
            assert a.release is False


def test_unit_times_out_and_aborts() -> None:
    st = state(started="2026-01-01T11:00:00Z")
    pods = [pod("p0", gate=False, ready=False, st=st)]
    p = run(spec(updateTimeoutSeconds=60), pods, {"p0": agent(phase=UpdatePhase.LOADING)})
    # an hour past the timeout (the abort's grace included): failed, then aborted best effort
    # (``domain/unit_timeout.py``: a failed abort call must not hold the verdict back)
    steps = [s for s in summary(p) if s[0] in ("AbortUpdate", "Settle")]
    assert steps == [("Settle", "p0"), ("AbortUpdate", "p0")]
    assert "UpdateTimeout" in p.reasons["p0"]


def test_gate_on_is_never_planned_without_commit() -> None:
    """Property over every non-committed agent answer: no GateOn for an in-flight pod."""
    for phase in [None, *UpdatePhase]:
        for reachable in (True, False):
            view = agent(phase=phase, reachable=reachable, update_version="v1")
            pods = [pod("p0", gate=False, ready=False, st=DRAINING)]
            p = run(spec(), pods, {"p0": view})
            assert not any(isinstance(a, GateOn) for a in p.actions), (phase, reachable)


# --------------------------------------------------------------------------------------------
# canary and pause
# --------------------------------------------------------------------------------------------


def test_canary_goes_first_then_pauses() -> None:
    pods = [pod(f"p{i}") for i in range(4)]
    s = spec(maxUnavailable=3, canary=1, pauseAfterCanary=True)
    assert claimed(run(s, pods, FRESH)) == ["p0"]
    # canary verified: hold, Paused with CanaryComplete
    pods[0] = pod("p0", st=state(UnitState.VERIFIED))
    agents = {**FRESH, "p0": agent("v2", committed_update_id="wu-v2")}
    p = run(s, pods, agents)
    assert claimed(p) == []
    assert p.paused_reason == Reason.CANARY_COMPLETE
    # promote: pauseAfterCanary false -> the rest goes, 3 at a time
    p = run(spec(maxUnavailable=3, canary=1), pods, agents)
    assert claimed(p) == ["p1", "p2", "p3"]


def test_canary_without_pause_waits_for_its_verdict() -> None:
    pods = [pod("p0", gate=False, ready=False, st=DRAINING), pod("p1"), pod("p2")]
    s = spec(maxUnavailable=3, canary=1)
    p = run(s, pods, {**FRESH, "p0": agent(phase=UpdatePhase.LOADING)})
    assert claimed(p) == []


def test_paused_holds_new_units_but_in_flight_finish() -> None:
    pods = [pod("p0", gate=False, ready=False, st=DRAINING), pod("p1")]
    p = run(
        spec(maxUnavailable=2, _spec={"paused": True}),
        pods,
        {**FRESH, "p0": agent("v2", phase=UpdatePhase.COMMITTED)},
    )
    assert summary(p)[:2] == [("GateOn", "p0"), ("Settle", "p0")]
    assert claimed(p) == []
    assert p.paused_reason == Reason.PAUSED_BY_SPEC


# --------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------


def test_group_is_one_unit() -> None:
    pods = [pod(f"g{g}-{i}", unit=f"g{g}") for g in range(2) for i in range(2)]
    p = run(spec(maxUnavailable=1), pods, {p.name: agent() for p in pods})
    assert claimed(p) == ["g0-0", "g0-1"]


def test_group_restored_only_when_every_member_committed() -> None:
    pods = [pod(f"g0-{i}", unit="g0", gate=False, ready=False, st=DRAINING) for i in range(2)]
    agents = {
        "g0-0": agent("v2", phase=UpdatePhase.COMMITTED),
        "g0-1": agent(phase=UpdatePhase.LOADING),
    }
    assert summary(run(spec(), pods, agents)) == []
    agents["g0-1"] = agent("v2", phase=UpdatePhase.COMMITTED)
    assert [t for t, _ in summary(run(spec(), pods, agents))].count("GateOn") == 2


def test_group_member_failure_fails_the_group() -> None:
    pods = [pod(f"g0-{i}", unit="g0", gate=False, ready=False, st=DRAINING) for i in range(2)]
    agents = {
        "g0-0": agent("v2", phase=UpdatePhase.COMMITTED),
        "g0-1": agent(phase=UpdatePhase.FAILED, reasons=["rank 1 missing"]),
    }
    p = run(spec(maxFailedReplicas=5), pods, agents)
    assert not any(isinstance(a, GateOn) for a in p.actions)
    assert {a.pod.name for a in p.actions if isinstance(a, Settle)} == {"g0-0", "g0-1"}


# --------------------------------------------------------------------------------------------
# failure budget, deadline, rollback
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_failed", "halted"), [(0, True), (1, False)])
def test_failure_budget(max_failed: int, halted: bool) -> None:
    pods = [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED)), pod("p1")]
    p = run(spec(maxUnavailable=2, maxFailedReplicas=max_failed), pods, FRESH)
    assert (p.persisted.aborted_at is not None) is halted
    assert claimed(p) == ([] if halted else ["p1"])
    if halted:
        assert p.persisted.abort_reason == Reason.FAILURE_BUDGET_EXCEEDED


def test_progress_deadline() -> None:
    persisted = Persisted(target_version="v2", last_progress_time="2026-01-01T10:00:00Z")
    pods = [pod("p0", ready=False, gate=False, st=DRAINING), pod("p1")]
    p = run(
        spec(progressDeadlineSeconds=60, updateTimeoutSeconds=99999),
        pods,
        {"p0": agent(phase=UpdatePhase.LOADING), "p1": agent()},
        persisted,
    )
    assert p.persisted.abort_reason == Reason.PROGRESS_DEADLINE_EXCEEDED


def test_rollback_targets_are_the_recorded_previous_weights() -> None:
    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    pods = [
        pod("p0", st=state(UnitState.VERIFIED)),
        pod("p1", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME),
        pod("p2"),  # never touched: left alone
        pod("p3", st=state(UnitState.VERIFIED, previous_source=None)),
    ]
    p = run(spec(maxUnavailable=4, onFailure="Rollback"), pods, FRESH, aborted)
    claims = {a.pod.name: a.state for a in p.actions if isinstance(a, Claim)}
    assert set(claims) == {"p0", "p1"}
    for st in claims.values():
        assert (st.state, st.version, st.rollback_of) == (UnitState.ROLLING_BACK, "v1", "v2")
        assert st.update_id == "wu-v1-g0-a1-rb"
    assert "NoRollbackTarget" in p.reasons["p3"]
    # next pass: drained rollback pod gets the previous source
    rb = claims["p1"]
    p = run(
        spec(onFailure="Rollback"),
        [pod("p1", gate=False, ready=False, st=rb)],
        {"p1": agent("v1", ready=False)},  # the failed update left it poisoned, not ready
        aborted,
    )
    start = next(a for a in p.actions if isinstance(a, StartUpdate))
    assert (start.request.version, start.request.source.uri) == ("v1", "/weights/v1")
    # committed: rolled back, traffic restored
    p = run(
        spec(onFailure="Rollback"),
        [pod("p1", gate=False, ready=False, st=rb)],
        {
            "p1": agent(
                "v1", phase=UpdatePhase.COMMITTED, update_version="v1", update_id="wu-v1-g0-a1-rb"
            )
        },
        aborted,
    )
    assert summary(p)[:2] == [("GateOn", "p1"), ("Settle", "p1")]
    assert p.classes["p1"] is PodClass.ROLLED_BACK


def test_halt_does_not_roll_back() -> None:
    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    p = run(spec(), [pod("p0", st=state(UnitState.VERIFIED)), pod("p1")], FRESH, aborted)
    assert [a for a in p.actions if isinstance(a, Claim)] == []


# --------------------------------------------------------------------------------------------
# convergence and ownership
# --------------------------------------------------------------------------------------------

DONE = Persisted(target_version="v2", completion_time="2026-01-01T11:00:00Z")


def test_convergence_updates_new_pods_of_a_succeeded_rollout() -> None:
    pods = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1-new", ready=False, gate=None)]
    p = run(spec(), pods, {"p1-new": agent("v1", ready=False)}, DONE)
    assert claimed(p) == ["p1-new"]


def test_new_pod_already_at_target_gets_its_gate() -> None:
    pods = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1", ready=False, gate=None)]
    p = run(spec(), pods, {"p1": agent("v2")}, DONE)
    # the record it had none of keeps what the gate vouches for (test_gate_on_vouch)
    assert summary(p) == [("GateOn", "p1"), ("Emit", Reason.UNIT_RESTORED), ("Settle", "p1")]


def test_new_pods_are_stale_while_paused() -> None:
    from weightroll_operator.domain.status import compute_counts

    pods = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1", ready=False, gate=None)]
    s = spec(_spec={"paused": True})
    p = run(s, pods, {"p1": agent("v1", ready=False)}, DONE)
    assert claimed(p) == []
    assert compute_counts(p, s).stale == 1


@pytest.mark.parametrize(("on_failure", "stale"), [("Halt", 1), ("Rollback", 0)])
def test_untouched_pods_after_a_halt_are_stale_unless_rolled_back(
    on_failure: str, stale: int
) -> None:
    """After a rollback every pod serves the previous version again: nothing is stale."""
    from weightroll_operator.domain.status import compute_counts

    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    pods = [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED)), pod("p1")]
    s = spec(onFailure=on_failure)
    p = run(s, pods, FRESH, aborted)
    assert "p1" not in claimed(p)  # a halt starts nothing new (a rollback drains p0 only)
    assert compute_counts(p, s).stale == stale


def test_pods_driven_by_another_update_block_the_rollout() -> None:
    pods = [pod("p0", st=state(by=OTHER, version="v3")), pod("p1")]
    p = run(spec(maxUnavailable=2), pods, FRESH)
    assert p.classes["p0"] is PodClass.BLOCKED
    assert p.blocked_by == ("ns/other",)
    assert p.actions == ()


def test_foreign_pods_after_completion_are_left_alone() -> None:
    pods = [pod("p0", st=state(UnitState.VERIFIED, by=OTHER, version="v3"))]
    p = run(spec(), pods, {"p0": agent("v3")}, DONE)
    assert p.classes["p0"] is PodClass.FOREIGN
    assert p.actions == ()


def test_restore_needs_an_agent_at_the_target() -> None:
    verified_off = pod("p0", gate=False, ready=False, st=state(UnitState.VERIFIED))
    assert summary(run(spec(), [verified_off], {"p0": agent("v2")}, DONE))[0] == ("GateOn", "p0")
    # the agent lost the weights (container restart): update again instead of restoring
    p = run(spec(), [verified_off], {"p0": agent("v1")}, DONE)
    assert not any(isinstance(a, GateOn) for a in p.actions)
    assert claimed(p) == ["p0"]


def test_queries_only_unsettled_pods() -> None:
    pods = (
        pod("done", st=state(UnitState.VERIFIED)),
        pod("flying", gate=False, ready=False, st=DRAINING),
        pod("failed", st=state(UnitState.FAILED), owner=ME),
        pod("fresh"),
        pod("blocked", owner=OTHER),
    )
    q = queries(pods, ME, "v2", V2_SRC)
    # a verified pod is asked again (its verdict stands only while its agent says so; the
    # reconciler answers it from its cache within the state TTL): issue 27 item 6; a failed
    # one too (a rollback claims it only when its agent runs nothing: its attempt may still)
    assert set(q) == {"done", "flying", "failed", "fresh"}
    assert q["flying"].update_id == "wu-v2" and not q["flying"].state
    assert q["fresh"].state


def test_completion() -> None:
    pods = [pod("p0", gate=False, ready=False, st=DRAINING)]
    p = run(spec(), pods, {"p0": agent("v2", phase=UpdatePhase.COMMITTED)})
    assert p.completed and p.persisted.completion_time == timestamp(NOW)


@pytest.mark.parametrize(
    ("failed", "completed", "p0_class"),
    [
        ((), True, PodClass.UPDATED),  # every write happened: completed this pass
        (("p0",), False, PodClass.IN_FLIGHT),  # its GateOn/Settle failed (409): not yet
        (("p9",), True, PodClass.UPDATED),  # a pod the plan does not know changes nothing
    ],
)
def test_a_completion_needs_the_writes_that_reach_it(
    failed: tuple[str, ...], completed: bool, p0_class: PodClass
) -> None:
    """Found by review: the last unit's GateOn failed (kubelet wrote the pod in between) and
    the pass still wrote Succeeded, with that pod out of traffic."""
    pods = [pod("p0", gate=False, ready=False, st=DRAINING)]
    before = Persisted(target_version="v2")
    p = run(spec(), pods, {"p0": agent("v2", phase=UpdatePhase.COMMITTED)})
    assert p.completed
    after = unsettled(p, failed, before)
    assert after.completed is completed
    assert (after.persisted.completion_time is not None) is completed
    assert after.classes["p0"] is p0_class
    # the unit finished (Event, unit-duration sample) only when its writes happened
    assert ("p0" in after.finished) is completed and ("p0" in after.durations) is completed
    # a completion persisted by an earlier pass stands
    earlier = Persisted(target_version="v2", completion_time=timestamp(NOW))
    assert unsettled(p, failed, earlier).completed


@pytest.mark.parametrize(
    ("unclaimed", "classes", "in_flight", "started"),
    [
        ((), [PodClass.IN_FLIGHT] * 3, 2, True),
        # the claim of p2 was dropped (its premise no longer held) or refused (409)
        (("p2",), [PodClass.IN_FLIGHT, PodClass.IN_FLIGHT, PodClass.PENDING], 1, True),
        # one pod of the group g: the other is draining, the unit is in flight still
        (("p0",), [PodClass.PENDING, PodClass.IN_FLIGHT, PodClass.IN_FLIGHT], 2, True),
        # no claim of the pass happened: nothing started
        (("p0", "p1", "p2"), [PodClass.PENDING] * 3, 0, False),
    ],
)
def test_a_claim_that_did_not_happen_is_not_reported_as_made(
    unclaimed: tuple[str, ...], classes: list[PodClass], in_flight: int, started: bool
) -> None:
    """A claim dropped by the reconciler's confirm step (or refused) leaves the pod as it was:
    not in flight in the status, and no start time for a rollout that started nothing."""
    pods = [pod("p0", unit="g"), pod("p1", unit="g"), pod("p2")]
    before = Persisted(target_version="v2")
    p = run(spec(maxUnavailable=2), pods, FRESH, before)
    assert (p.in_flight_units, sorted(p.claimed_from)) == (2, ["p0", "p1", "p2"])
    after = unsettled(p, (), before, unclaimed=unclaimed)
    assert [after.classes[n] for n in ("p0", "p1", "p2")] == classes
    assert after.in_flight_units == in_flight
    assert (after.persisted.start_time is not None) is started


_VERIFIED = {f"p{i}": Emit("UnitVerified", f"Verified p{i}", pods=(f"p{i}",)) for i in range(3)}


@pytest.mark.parametrize(
    ("emits", "unwritten", "expected"),
    [
        # an Event that reports no pod write holds whatever failed
        ([Emit("CanaryFailed", "Halted")], {"p0"}, "Halted"),
        # one unit: left out when its pod's writes failed
        ([_VERIFIED["p0"]], set(), "Verified p0"),
        ([_VERIFIED["p0"]], {"p0"}, None),
        ([_VERIFIED["p0"]], {"p1"}, "Verified p0"),
        # an aggregate keeps the units whose writes happened, worded anew
        (list(_VERIFIED.values()), set(), "3 units: Verified p0; Verified p1; Verified p2"),
        (list(_VERIFIED.values()), {"p1"}, "2 units: Verified p0; Verified p2"),
        (list(_VERIFIED.values()), {"p0", "p2"}, "Verified p1"),
        (list(_VERIFIED.values()), {"p0", "p1", "p2"}, None),
    ],
)
def test_an_event_is_posted_only_for_the_writes_that_happened(
    emits: list[Emit], unwritten: set[str], expected: str | None
) -> None:
    """Found by review: a 409 on a unit's Settle kept it in flight, and the next pass posted
    ``UnitVerified`` (and observed its duration) a second time."""
    merged = aggregate_emits(emits)
    assert merged is not None
    held = emit_holding(merged, frozenset(unwritten))
    assert (held.message if held is not None else None) == expected


def test_restart_between_gate_on_and_settle_finishes_without_draining_again() -> None:
    pods = [pod("p0", gate=True, ready=True, st=DRAINING)]
    p = run(spec(), pods, {"p0": agent("v2", phase=UpdatePhase.COMMITTED)})
    assert summary(p) == [("Settle", "p0"), ("Emit", Reason.UNIT_VERIFIED)]


def _peer(
    name: str,
    phase: str | None,
    created: str = "2026-01-01T10:00:00Z",
    app: str = "llm",
    done: bool = False,
) -> dict[str, object]:
    status: dict[str, object] = {"phase": phase} if phase is not None else {}
    if done:
        status |= {"completionTime": "2026-01-01T11:00:00Z", "targetVersion": "v9"}
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "version": "v9",
            "source": {"uri": "/w"},
        },
        "status": status,
    }


#: My own creation: ``ns/wu`` created at 10:00:00.
MINE = {"name": "wu", "namespace": "ns", "creationTimestamp": "2026-01-01T10:00:00Z"}
EARLIER, LATER = "2026-01-01T09:00:00Z", "2026-01-01T11:00:00Z"


@pytest.mark.parametrize(
    ("peer", "finished", "blocked", "superseded"),
    [
        # an older, unfinished WeightUpdate goes first, started or not (item 3: two created
        # together both drained in their first passes, before either had a status)
        (_peer("a", None, EARLIER), False, True, False),
        (_peer("a", "Pending", EARLIER), False, True, False),
        (_peer("a", "Progressing", EARLIER), False, True, False),
        (_peer("a", "Paused", EARLIER), False, True, False),
        (_peer("a", "RollingBack", EARLIER), False, True, False),
        # ... but not once it finished, or halted
        (_peer("a", "Succeeded", EARLIER, done=True), False, False, False),
        (_peer("a", "Progressing", EARLIER, done=True), False, False, False),  # converging
        (_peer("a", "Failed", EARLIER), False, False, False),
        (_peer("a", "Progressing", EARLIER, app="other"), False, False, False),
        # a younger one waits for me while I am unfinished
        (_peer("b", "Progressing", LATER), False, False, False),
        (_peer("b", None, LATER), False, False, False),
        # once I finished, a younger one that selects the pods is the newer intent (item 11)
        (_peer("b", "Succeeded", LATER, done=True), True, False, True),
        (_peer("b", None, LATER), True, False, True),
        (_peer("b", "Failed", LATER), True, False, False),  # halted: converges nothing
        (_peer("b", None, LATER, app="other"), True, False, False),
        # created in the same second: the smaller name is the older ("ns/a" < "ns/wu")
        (_peer("a", None), False, True, False),
        (_peer("zz", None), False, False, False),
        (_peer("wu", "Progressing", EARLIER), False, False, False),  # itself
    ],
)
def test_fleet_level_ownership(
    peer: dict[str, object], finished: bool, blocked: bool, superseded: bool
) -> None:
    from weightroll_operator.domain.ownership import precedence

    ranks = precedence(ME, MINE, finished, (pod("p0"),), [peer])
    assert bool(ranks.blocked_by) is blocked
    assert (ranks.superseded == {"p0"}) is superseded
    from weightroll_operator.domain.plan import Fleet, plan

    fleet = Fleet(
        name="wu",
        owner=ME,
        pods=(pod("p0"),),
        agents=FRESH,
        peers=ranks.blocked_by,
        superseded=ranks.superseded,
    )
    persisted = Persisted(
        target_version="v2", completion_time="2026-01-01T10:30:00Z" if finished else None
    )
    p = plan(spec(), fleet, persisted, NOW)
    # blocked or superseded, the planner starts nothing; superseded pods are no work of mine
    assert (claimed(p) == []) is (blocked or superseded)
    assert p.blocked_by == ranks.blocked_by
    if superseded:
        assert p.classes["p0"] is PodClass.FOREIGN and p.completed


def test_version_change_retargets_units_not_yet_started() -> None:
    old = state(version="v1b", update_id="wu-v1b")
    pods = [pod("p0", gate=False, ready=False, st=old)]
    p = run(spec(), pods, {"p0": agent("v1")})  # the agent never heard of wu-v1b
    claim = p.actions[0]
    assert isinstance(claim, Claim)
    assert (claim.state.version, claim.state.update_id) == ("v2", "wu-v2-g0-a1")
    assert claim.state.previous_version == "v1"
    assert not any(isinstance(a, StartUpdate) for a in p.actions)
    # already started: it finishes at its version first
    started = agent("v1", phase=UpdatePhase.LOADING, update_id="wu-v1b", update_version="v1b")
    p = run(spec(), pods, {"p0": started})
    assert p.actions == ()


def test_agent_that_lost_the_update_record_but_serves_the_version_is_not_reloaded() -> None:
    pods = [pod("p0", gate=False, ready=False, st=DRAINING)]
    # 404 for the id; the live state: ranks at v2, committed by this very attempt
    p = run(spec(), pods, {"p0": agent("v2", ready=True, committed_update_id="wu-v2")})
    assert summary(p)[:2] == [("GateOn", "p0"), ("Settle", "p0")]
    # at v2 but committed by another attempt (an old verdict), or by nobody known: reload
    for other in ("wu-v2-old", None):
        p = run(spec(), pods, {"p0": agent("v2", ready=True, committed_update_id=other)})
        assert summary(p) == [("StartUpdate", "p0")], other
    # not ready at v2 (e.g. still paused): never restored, the update is sent (idempotent)
    p = run(spec(), pods, {"p0": agent("v2", ready=False)})
    assert summary(p) == [("StartUpdate", "p0")]


def test_rollback_phase_does_not_flicker_when_the_last_forward_unit_ends() -> None:
    from weightroll_operator.domain.status import compute_phase

    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    pods = [pod("p0", gate=False, ready=False, st=DRAINING)]
    s = spec(onFailure="Rollback")
    p = run(s, pods, {"p0": agent("v2", phase=UpdatePhase.COMMITTED)}, aborted)
    assert p.finished == {"p0": "succeeded"}
    assert compute_phase(p, s).value == "RollingBack"


def test_verified_pod_whose_containers_restarted_is_asked_again_and_re_updated() -> None:
    """vLLM restarted under a verified pod: its gate is still True but the pod is not Ready.

    The operator must ask the agent (which now reports boot weights) and update the pod again,
    not keep counting it as verified.
    """
    settled = pod("p0", st=state(UnitState.VERIFIED))
    restarted = pod("p0", st=state(UnitState.VERIFIED), ready=False)
    # both are asked (a verified pod in traffic from the reconciler's cache, within its TTL)
    assert "p0" in queries((settled,), ME, "v2", V2_SRC)
    assert "p0" in queries((restarted,), ME, "v2", V2_SRC)
    p = run(spec(), [restarted], {"p0": agent("boot", ready=False)}, DONE)
    assert claimed(p) == ["p0"]


@pytest.mark.parametrize(
    ("held", "halted"),
    [
        (True, False),  # the hold just ended (resume / promote): the clock restarts now
        (False, True),  # no hold: 2 h without progress is past the 60 s deadline
    ],
)
def test_time_on_hold_does_not_count_against_the_progress_deadline(
    held: bool, halted: bool
) -> None:
    long_ago = "2026-01-01T08:00:00Z"  # hours before NOW
    persisted = Persisted(target_version="v2", last_progress_time=long_ago, held=held)
    pods = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1")]
    s = spec(progressDeadlineSeconds=60, canary=1)  # promoted: pauseAfterCanary now false
    p = run(s, pods, {**FRESH, "p0": SERVING_V2}, persisted)
    assert (p.persisted.abort_reason == Reason.PROGRESS_DEADLINE_EXCEEDED) is halted
    if not halted:
        assert claimed(p) == ["p1"]
        assert p.persisted.last_progress_time != long_ago


def test_persisted_remembers_a_hold_from_the_status_phase() -> None:
    status = WeightUpdateStatus(target_version="v2", phase=Phase.PAUSED)
    assert Persisted.from_status(status, "v2").held
    assert not Persisted.from_status(
        status.model_copy(update={"phase": Phase.PROGRESSING}), "v2"
    ).held
    assert not Persisted.from_status(status, "v3").held  # a new version starts from scratch


# --------------------------------------------------------------------------------------------
# issue 11: attempt identity, truth after commit, budget, joining pods, deadlines
# --------------------------------------------------------------------------------------------


def test_every_claim_is_a_new_attempt_with_its_own_id() -> None:
    from weightroll_operator.domain.plan import Fleet, plan

    earlier = state(UnitState.VERIFIED, version="v2", update_id="wu-v2-g1-a3", attempt=3)
    # the pod serves v1 again (a flip back): pending, claimed by attempt 4 of generation 7
    fleet = Fleet(
        name="wu",
        owner=ME,
        pods=(pod("p0", st=earlier),),
        agents={"p0": agent("v1")},
        uid="0f3c2a91-aaaa-bbbb",
        generation=7,
    )
    p = plan(spec(), fleet, Persisted(target_version="v2"), NOW)
    [claim] = [a for a in p.actions if isinstance(a, Claim)]
    assert (claim.state.update_id, claim.state.attempt) == ("wu-v2-0f3c2a91-g7-a4", 4)
    # a pod last driven by another WeightUpdate goes on counting from that one's claims
    foreign = state(UnitState.VERIFIED, by=OTHER, version="v1", attempt=9)
    fleet = Fleet(name="wu", owner=ME, pods=(pod("p0", st=foreign),), agents={"p0": agent("v1")})
    [claim] = [a for a in plan(spec(), fleet, Persisted(target_version="v2"), NOW).actions[:1]]
    assert isinstance(claim, Claim) and claim.state.attempt == 10


def test_an_attempt_id_never_repeats_after_another_weightupdate_drove_the_pod() -> None:
    """A verifies p0 (attempt 1); B claims it and is deleted (its release records
    ``B~deleted``); A claims p0 again. Its id must differ from attempt 1's: the agent keeps that
    record (Committed), and a repeated id would be answered with it instead of a reload."""
    from weightroll_operator.domain.model import OwnerKey, WeightState
    from weightroll_operator.domain.plan import Fleet, plan

    def claim_of(
        st: WeightState | None, owner: OwnerKey, version: str, seen: AgentView
    ) -> WeightState:
        fleet = Fleet(
            name=owner.split("/")[1],
            owner=owner,
            pods=(pod("p0", st=st),),
            agents={"p0": seen},
            uid="0f3c2a91-aaaa",
            generation=1,
        )
        target = spec(_spec={"version": version, "source": {"uri": f"/weights/{version}"}})
        actions = plan(target, fleet, Persisted(target_version=version), NOW).actions
        [claim] = [a for a in actions if isinstance(a, Claim)]
        return claim.state

    first = claim_of(None, ME, "v2", agent("v1"))
    by_b = claim_of(first.evolve(state=UnitState.VERIFIED), OTHER, "v3", agent("v2"))
    # B's update failed (the agent holds the replica) and B was deleted
    released = by_b.evolve(state=UnitState.FAILED, by=OwnerKey(f"{OTHER}~deleted"))
    again = claim_of(released, ME, "v2", agent("v2", ready=False))
    assert (first.attempt, by_b.attempt, again.attempt) == (1, 2, 3)
    assert again.update_id != first.update_id


@pytest.mark.parametrize(
    ("live", "expected"),
    [
        # the agent's record says Committed and the ranks serve it, by this attempt: restore
        ({}, [("GateOn", "p0"), ("Settle", "p0"), ("Emit", Reason.UNIT_VERIFIED)]),
        # committed and served but not resumed yet: wait
        ({"ready": False}, []),
        # committed, but vLLM restarted since (boot weights): a fresh attempt, still drained
        ({"version": "v1", "committed_update_id": None}, [("Claim", "p0")]),
    ],
)
def test_gate_on_needs_the_live_state_of_this_attempt(
    live: dict[str, object], expected: list[tuple[str, str]]
) -> None:
    view = agent(phase=UpdatePhase.COMMITTED, **live)  # type: ignore[arg-type]
    p = run(spec(), [pod("p0", gate=False, ready=False, st=DRAINING)], {"p0": view})
    assert summary(p) == expected
    if expected == [("Claim", "p0")]:
        claim = p.actions[0]
        assert isinstance(claim, Claim) and claim.state.update_id == "wu-v2-g0-a1"
        assert claim.state.started_at == DRAINING.started_at  # the unit's deadline holds


def test_verified_pod_serving_other_weights_is_pending_again() -> None:
    """The agent reports what its ranks serve: boot weights after a vLLM restart."""
    restarted = pod("p0", st=state(UnitState.VERIFIED), ready=False)
    held = agent("v1", ready=False)  # held by the agent (engine_restarted), ranks clean at v1
    p = run(spec(), [restarted], {"p0": held}, DONE)
    [claim] = [a for a in p.actions if isinstance(a, Claim)]  # pending again: claimed
    assert claim.state.previous_version == "v1" and claim.state.attempt == 1


@pytest.mark.parametrize(
    ("live", "re_updated"),
    [
        (agent("v2"), False),  # ready at the version: still verified (traffic restored)
        (agent("v2", ready=False, clean=False), True),  # poisoned by a failed trainer push
        (agent("v2", ready=False), True),  # held or paused at the version
        (agent("v2", reachable=False), False),  # unknown: left alone (and left drained)
    ],
)
def test_verified_pod_whose_agent_is_not_ready_at_the_version_is_updated_again(
    live: AgentView, re_updated: bool
) -> None:
    """Same version, but its agent no longer vouches for it: updated again, with the reason."""
    drained = pod("p0", st=state(UnitState.VERIFIED), ready=False)
    p = run(spec(), [drained], {"p0": live}, DONE)
    assert (claimed(p) == ["p0"]) is re_updated
    assert (p.classes["p0"] is PodClass.UPDATED) is not re_updated
    assert ("not ready" in p.notes.get("p0", "")) is (re_updated and live.version == "v2")


def test_stale_view_is_unavailable_and_untouched() -> None:
    """A view older than our own last write to the pod: its unit gets no step and counts as
    unavailable, so the next unit waits (the budget holds until the pod is seen Ready)."""
    from dataclasses import replace

    done_now = pod("p0", gate=False, ready=False, st=DRAINING)
    fresh = [replace(done_now, stale=True), pod("p1")]
    view = agent(phase=UpdatePhase.COMMITTED)
    p = run(spec(maxUnavailable=1), fresh, {"p0": view, "p1": agent("v1")})
    assert p.actions == ()
    # seen again after the write, gate True but kubelet not yet Ready: still unavailable
    restored = pod("p0", gate=True, ready=False, st=state(UnitState.VERIFIED))
    p = run(spec(maxUnavailable=1), [restored, pod("p1")], {"p1": agent("v1")})
    assert claimed(p) == []
    verified = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1")]
    p = run(spec(maxUnavailable=1), verified, {**FRESH, "p0": SERVING_V2})
    assert claimed(p) == ["p1"]


@pytest.mark.parametrize(
    ("view", "claimable"),
    [
        (agent("v1"), True),
        (agent("", ready=False, clean=False), False),  # booting: version unknown
        (agent("v1", clean=False, ready=False), True),  # poisoned: a full update recovers it
        (agent("v1", active_update_id="someone-else"), False),
        (agent("v1", reachable=False), False),
    ],
)
def test_joining_pods_are_claimed_only_at_a_known_clean_version(
    view: object, claimable: bool
) -> None:
    p = run(spec(), [pod("p0", ready=False, gate=None)], {"p0": view})  # type: ignore[dict-item]
    assert (claimed(p) == ["p0"]) is claimable
    if not claimable and p.classes["p0"] is PodClass.PENDING:
        assert "Joining" in p.notes["p0"]


def test_update_timer_starts_when_the_agent_accepts() -> None:
    from weightroll_operator.domain.model import UpdateView

    claimed_long_ago = state(started="2026-01-01T11:00:00Z")
    pods = [pod("p0", gate=False, ready=False, st=claimed_long_ago)]
    recent = UpdateView(
        id="wu-v2", phase=UpdatePhase.LOADING, version="v2", started_at="2026-01-01T11:59:30Z"
    )
    running = agent(phase=UpdatePhase.LOADING)
    p = run(spec(updateTimeoutSeconds=60), pods, {"p0": replace_update(running, recent)})
    assert p.actions == ()  # accepted 30 s ago: within the 60 s timeout
    late = UpdateView(
        id="wu-v2", phase=UpdatePhase.LOADING, version="v2", started_at="2026-01-01T11:58:30Z"
    )
    p = run(spec(updateTimeoutSeconds=60), pods, {"p0": replace_update(running, late)})
    # timed out: aborted; the unit's verdict is the agent's answer (``domain/unit_timeout.py``)
    assert summary(p) == [("AbortUpdate", "p0")]


def replace_update(view: object, update: object) -> object:
    from dataclasses import replace

    return replace(view, update=update)  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("floor", "halted"),
    [
        ("2026-01-01T11:59:30Z", False),  # the operator started 30 s ago: downtime not counted
        (None, True),
        ("2026-01-01T08:00:00Z", True),  # started long ago: the deadline counts from progress
    ],
)
def test_operator_downtime_does_not_count_against_the_progress_deadline(
    floor: str | None, halted: bool
) -> None:
    persisted = Persisted(
        target_version="v2",
        start_time="2026-01-01T09:00:00Z",
        last_progress_time="2026-01-01T09:00:00Z",
        clock_floor=floor,
    )
    pods = [pod("p0", gate=False, ready=False, st=state(started="2026-01-01T11:59:50Z"))]
    p = run(
        spec(progressDeadlineSeconds=600), pods, {"p0": agent(phase=UpdatePhase.LOADING)}, persisted
    )
    assert (p.persisted.abort_reason == Reason.PROGRESS_DEADLINE_EXCEEDED) is halted


def test_blocked_time_does_not_count_against_the_progress_deadline() -> None:
    from weightroll_operator.domain.plan import Fleet, plan

    old = "2026-01-01T08:00:00Z"
    fleet = Fleet(name="wu", owner=ME, pods=(pod("p0"),), agents=FRESH, peers=("ns/first",))
    blocked = plan(
        spec(progressDeadlineSeconds=60),
        fleet,
        Persisted(target_version="v2", start_time=old, last_progress_time=old),
        NOW,
    )
    assert blocked.persisted.aborted_at is None  # blocked: no deadline
    # the blocker finished: the clock restarts now instead of halting at once
    status = WeightUpdateStatus(target_version="v2", phase=Phase.PROGRESSING)
    status = status.model_copy(
        update={
            "conditions": [
                Condition(
                    type=ConditionType.BLOCKED,
                    status=ConditionStatus.TRUE,
                    reason="OwnedByOtherWeightUpdate",
                )
            ]
        }
    )
    persisted = Persisted.from_status(status, "v2")
    assert persisted.held
    free = Fleet(name="wu", owner=ME, pods=(pod("p0"),), agents=FRESH)
    p = plan(spec(progressDeadlineSeconds=60), free, persisted, NOW)
    assert p.persisted.aborted_at is None and claimed(p) == ["p0"]


@pytest.mark.parametrize("max_failed", [0, 3])
def test_failed_canary_halts_whatever_max_failed_replicas_says(max_failed: int) -> None:
    failed = state(UnitState.FAILED, reason="DigestMismatch")
    pods = [pod("p0", gate=False, ready=False, st=failed, owner=ME), pod("p1"), pod("p2")]
    p = run(spec(canary=1, maxFailedReplicas=max_failed), pods, FRESH)
    assert p.persisted.abort_reason == Reason.CANARY_FAILED
    assert claimed(p) == []


def test_retry_tries_failed_pods_again_with_a_new_attempt() -> None:
    failed = state(UnitState.FAILED, reason="DigestMismatch", attempt=1, update_id="wu-v2-g0-a1")
    pods = [pod("p0", gate=False, ready=False, st=failed, owner=ME), pod("p1")]
    halted = Persisted(
        target_version="v2", aborted_at="2026-01-01T11:59:00Z", abort_reason="FailureBudgetExceeded"
    )
    assert claimed(run(spec(), pods, FRESH, halted)) == []
    # weightroll retry: abortedAt cleared, retriedAt after the failed attempt started
    retried = Persisted(target_version="v2", retried_at="2026-01-01T11:59:30Z")
    p = run(spec(), pods, {**FRESH, "p0": agent("v1", ready=False, clean=False)}, retried)
    assert p.persisted.aborted_at is None
    [claim] = [a for a in p.actions if isinstance(a, Claim)]
    assert (claim.pod.name, claim.state.attempt, claim.state.previous_version) == ("p0", 2, "v1")
    assert claim.state.update_id == "wu-v2-g0-a2"


#: A fleet of two verified pods whose rollout holds its whole budget of 1 on a third (in flight).
_BUSY = [pod("p1", gate=False, ready=False, st=state(UnitState.DRAINING, update_id="wu-v2-b"))]


@pytest.mark.parametrize(
    ("live", "gate", "withdrawn"),
    [
        # restarted without its state onto the boot weights, Ready: withdrawn, gate re-attested
        (agent("v1"), True, "the agent serves v1, not v2"),
        # the same, out of traffic by our gate: claimed at once (free), the claim rewrites it
        (agent("v1"), False, None),
        # a trainer pushed other weights under the same label, committed by its own update
        (agent("v2", committed_update_id="push-7"), True, "committed by push-7"),
        (agent("v2", source=None), True, "from other files"),
        # still vouching (boot at v2 reports no commit), or not able to vouch: left standing
        (agent("v2", committed_update_id=None), True, None),
        (SERVING_V2, True, None),
        (agent("v1", ready=False), True, None),
        (agent("v1", reachable=False), True, None),
    ],
)
def test_a_contradicted_verdict_is_withdrawn_while_the_budget_is_spent(
    live: AgentView, gate: bool, withdrawn: str | None
) -> None:
    """Found by the simulation tier: a verified pod whose agent came back without its state on
    the boot weights kept ``Verified`` at v2 and its ``weight-version=v2`` label, Ready, for as
    long as another unit held the budget. The record follows the agent at once; the drain waits
    for the budget."""
    p0 = pod("p0", st=state(UnitState.VERIFIED), gate=gate, ready=gate)
    p = run(spec(maxUnavailable=1), [p0, *_BUSY], {"p0": live}, Persisted(target_version="v2"))
    assert claimed(p) == ([] if gate else ["p0"])  # the budget is p1's
    settles = [a for a in p.actions if isinstance(a, Settle) and a.pod.name == "p0"]
    gates = [a for a in p.actions if isinstance(a, GateOn) and a.pod.name == "p0"]
    if withdrawn is None:
        assert settles == [] and gates == []
        return
    [settle] = settles
    assert settle.state.state is UnitState.WITHDRAWN and withdrawn in settle.state.reason
    assert settle.state.attempt == p0.state.attempt  # type: ignore[union-attr]
    assert settle.labels == {"weightroll.io/weight-version": live.version}
    assert [(g.version, g.reason) for g in gates] == [(live.version, "Reattested")]
    assert p.classes["p0"] is PodClass.PENDING
    again = run(spec(maxUnavailable=1), [pod("p0", st=settle.state, gate=gate), *_BUSY],
                {"p0": live}, Persisted(target_version="v2"))  # fmt: skip
    assert [a for a in again.actions if not isinstance(a, Emit)] == []  # withdrawn once


@pytest.mark.parametrize(("budget", "drained"), [(1, False), (2, True)])
def test_a_claim_whose_drain_never_landed_waits_for_a_slot(budget: int, drained: bool) -> None:
    """Found by the simulation tier: an operator stopped between a claim and its drain, the
    budget lowered meanwhile; the standby drained the claimed pod beside the unit holding the
    only slot. Its drain waits for a slot like a new claim (``plan.advance``)."""
    p0 = pod("p0", st=state(UnitState.DRAINING, update_id="wu-v2-a"))
    p1 = pod("p1", gate=False, ready=False, st=state(UnitState.DRAINING, update_id="wu-v2-b"))
    p = run(spec(maxUnavailable=budget), [p0, p1, pod("p2")],
            {"p0": agent("v1"), "p1": agent("v1"), "p2": agent("v1")})  # fmt: skip
    gates = [a.pod.name for a in p.actions if isinstance(a, GateOff)]
    assert gates == (["p0"] if drained else [])
    assert claimed(p) == []  # the waiting claim goes before any new one
    assert p.classes["p0"] is PodClass.IN_FLIGHT


@pytest.mark.parametrize(
    ("now", "containers_ready", "live", "expected", "unknown"),
    [
        # restarted, its agent silent: nothing vouches for what it serves: out of traffic
        ("uid|ip|1", True, agent("v1", reachable=False), [("GateOff", "VerdictOutlived")], True),
        # the same containers, silent: the verdict stands (the readiness probe guards them)
        ("uid|ip|0", True, agent("v1", reachable=False), [], False),
        # the same containers turned NotReady, silent: not seen serving, so no verdict is
        # shown; kubelet keeps them out already, so the gate stays
        ("uid|ip|0", False, agent("v1", reachable=False), [], True),
        # NotReady, but the agent answers and confirms: the verdict stands
        ("uid|ip|0", False, SERVING_V2, [], False),
        # restarted, the new containers' agent confirms: the verdict is recorded for them
        ("uid|ip|1", True, SERVING_V2, [("Settle", "uid|ip|1")], False),
    ],
)
def test_a_verdict_vouches_for_the_containers_it_was_made_on(
    now: str,
    containers_ready: bool,
    live: AgentView,
    expected: list[tuple[str, str]],
    unknown: bool,
) -> None:
    """Found by the simulation tier: behind a partition from the operator, a verified pod
    restarted onto its boot weights stayed Ready under a gate set for v2, and one whose vLLM
    restarted (NotReady, no restart counted yet) stayed listed ``Verified`` at v2
    (``domain.standing``)."""
    st = state(UnitState.VERIFIED).evolve(incarnation="uid|ip|0")
    p0 = dataclasses.replace(
        pod("p0", st=st, ready=containers_ready),
        incarnation=now,
        containers_ready=containers_ready,
    )
    p = run(spec(maxUnavailable=1), [p0, pod("p1", st=state(UnitState.VERIFIED))],
            {"p0": live, "p1": SERVING_V2})  # fmt: skip
    acts = [a for a in p.actions if not isinstance(a, Emit)]
    assert [
        (type(a).__name__, a.reason if isinstance(a, GateOff) else str(a.state.incarnation))
        for a in acts
        if isinstance(a, GateOff | Settle)
    ] == expected
    assert len(acts) == len(expected)
    assert p.classes["p0"] is (PodClass.UNKNOWN if unknown else PodClass.UPDATED)


def test_a_contradicted_verdict_is_withdrawn_resting_on_the_answer_that_contradicts_it() -> None:
    """The withdrawal (and the gate attested again for what the pod serves) rests on the
    agent's answer: the reconciler applies it only while the agent still says it (a cached
    answer is asked again first, ``reconcile/confirm.py``)."""
    p0 = pod("p0", st=state(UnitState.VERIFIED))
    fleet = Fleet(name="wu", owner=ME, pods=(p0, *_BUSY), agents={"p0": agent("v1")})
    p = plan(spec(maxUnavailable=1), fleet, Persisted(target_version="v2"), NOW)
    assert [a.state.state for a in p.actions if isinstance(a, Settle)] == [UnitState.WITHDRAWN]
    assert p.premises == (Premise(("p0",), {"p0": agent("v1")}),)


def test_a_new_pod_serving_the_rollback_target_gets_its_gate_during_a_rollback() -> None:
    """Found by the simulation tier: a pod that joined a halted rollout with onFailure
    Rollback (gate never set) stayed drained, held the whole budget, and the rollback of p0
    never got a slot: RollingBack for ever, blocking a younger WeightUpdate over the pods."""
    halted = Persisted(target_version="v2", aborted_at=timestamp(NOW), abort_reason="X")
    pods = [pod("p0", st=state(UnitState.VERIFIED)), pod("p1", gate=None, ready=False)]
    answers = {"p0": SERVING_V2, "p1": agent("v1", source=V1_SRC)}
    p = run(spec(maxUnavailable=1, onFailure="Rollback"), pods, answers, halted)
    gates = [(a.pod.name, a.version, a.reason) for a in p.actions if isinstance(a, GateOn)]
    assert gates == [("p1", "v1", "ServingRollbackTarget")]
    # other files under the label are not the rollback's target: left drained
    answers["p1"] = agent("v1", source=V2_SRC)
    p = run(spec(maxUnavailable=1, onFailure="Rollback"), pods, answers, halted)
    assert not any(isinstance(a, GateOn) for a in p.actions)


def test_a_rollback_waits_for_a_failed_attempt_still_running_and_aborts_it_again() -> None:
    """An operator stopped between a unit's Settle(Failed) and its AbortUpdate (a crash, the
    Lease fence) left the attempt running: a rollback claim (a new attempt) waits for the agent
    to run nothing, and the failed attempt, still ours, is aborted again (simulation tier)."""
    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    failed = pod("p1", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME)
    assert failed.state is not None
    running = failed.state.update_id
    still_running = agent("v1", ready=False, active_update_id=running)
    p = run(spec(maxUnavailable=4, onFailure="Rollback"), [failed], {"p1": still_running}, aborted)
    assert not claimed(p)
    assert [(a.pod.name, a.update_id) for a in p.actions if isinstance(a, AbortUpdate)] == [
        ("p1", failed.state.update_id)
    ]
    # another attempt running (not ours to abort): the rollback only waits
    other = agent("v1", ready=False, active_update_id="someone-else")
    p = run(spec(maxUnavailable=4, onFailure="Rollback"), [failed], {"p1": other}, aborted)
    assert not claimed(p) and not [a for a in p.actions if isinstance(a, AbortUpdate)]
    # once it ran to its end, the rollback claims
    p = run(spec(maxUnavailable=4, onFailure="Rollback"), [failed], {"p1": agent("v1")}, aborted)
    assert claimed(p) == ["p1"]
