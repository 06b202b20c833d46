"""Claims, the canary and unit timers after faults (issue 11, D, H and C), found by the
session-7 review: each case planned the wrong thing before its fix."""

from __future__ import annotations

from dataclasses import replace

import pytest
from weightroll_operator.domain.actions import AbortUpdate, Claim, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import UnitState
from weightroll_operator.domain.plan import Fleet, Persisted, PodClass, Premise, plan, queries

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import (
    ME,
    NOW,
    V2_SRC,
    agent,
    pod,
    run,
    spec,
    state,
)

FRESH = {f"p{i}": agent("v1") for i in range(6)}
#: ``weightroll retry`` after the failed canary below
RETRIED = Persisted(target_version="v2", retried_at="2026-01-01T11:59:30Z")
AT_V2 = Persisted(target_version="v2")


def claimed(p: object) -> list[str]:
    return [a.pod.name for a in p.actions if isinstance(a, Claim)]  # type: ignore[attr-defined]


def _failed_canary() -> list[object]:
    failed = state(UnitState.FAILED, reason="DigestMismatch", attempt=1)
    return [pod("p0", gate=False, ready=False, st=failed, owner=ME), pod("p1"), pod("p2")]


@pytest.mark.parametrize("pause_after_canary", [False, True])
def test_a_retried_canary_goes_first_again(pause_after_canary: bool) -> None:
    """Before: the failed canary still counted as the canary's verdict, so the retry claimed
    the whole fleet at once, or (pauseAfterCanary) held it as "CanaryComplete"."""
    s = spec(maxUnavailable=3, canary=1, pauseAfterCanary=pause_after_canary)
    p = run(s, _failed_canary(), FRESH, RETRIED)  # type: ignore[arg-type]
    assert claimed(p) == ["p0"]
    assert p.paused_reason is None


def test_a_retried_canary_holds_the_rest_until_its_new_verdict() -> None:
    s = spec(maxUnavailable=3, canary=1)
    again = state(UnitState.DRAINING, attempt=2, started="2026-01-01T11:59:40Z")
    pods = [pod("p0", gate=False, ready=False, st=again), pod("p1"), pod("p2")]
    p = run(s, pods, {**FRESH, "p0": agent(phase=UpdatePhase.LOADING)}, RETRIED)
    assert claimed(p) == []


def test_a_canary_whose_engine_restarted_stays_the_canary() -> None:
    """The canary is the first unit touched, whatever it wants now: a later failure that
    ``maxFailedReplicas`` allows is not taken for a failed canary (no halt, no rollback)."""
    verified = state(UnitState.VERIFIED, started="2026-01-01T11:50:00Z")
    failed = state(UnitState.FAILED, reason="DigestMismatch", started="2026-01-01T11:55:00Z")
    pods = [
        pod("p0", gate=False, ready=False, st=verified),  # vLLM restarted under it
        pod("p1", gate=False, ready=False, st=failed, owner=ME),
        pod("p2"),
    ]
    s = spec(maxUnavailable=3, canary=1, maxFailedReplicas=1, onFailure="Rollback")
    p = run(s, pods, {**FRESH, "p0": agent("v1", ready=False)})
    assert p.persisted.aborted_at is None
    assert "p0" in claimed(p)


def test_a_booting_pod_tried_before_is_not_claimed() -> None:
    """Before: a pod this WeightUpdate had tried was claimed whatever its agent said, so a
    booting engine (vLLM not up: no version) failed the unit on its boot time and could halt
    or roll back the fleet."""
    failed = state(UnitState.FAILED, reason="UpdateTimeout", attempt=1)
    pods = [pod("p0", gate=False, ready=False, st=failed, owner=ME)]
    booting = agent("", ready=False, clean=False)
    p = run(spec(), pods, {"p0": booting}, RETRIED)
    assert claimed(p) == []
    assert p.notes["p0"].startswith("Joining")
    assert claimed(run(spec(), pods, {"p0": agent("v1", ready=False, clean=False)}, RETRIED)) == [
        "p0"
    ]
    # vLLM answers, but a failed commit left the ranks on different versions (no one version):
    # the retry still reloads it (its previous weights are recorded)
    mixed = agent("", ready=False, clean=False, engine_seen=True)
    assert claimed(run(spec(), pods, {"p0": mixed}, RETRIED)) == ["p0"]


def _claimable_fleet(pods: tuple[object, ...] = (pod("p0"), pod("p1"))) -> Fleet:
    asked = queries(pods, ME, "v2", V2_SRC)  # type: ignore[arg-type]
    return Fleet(
        name="wu",
        owner=ME,
        pods=pods,  # type: ignore[arg-type]
        agents={k: v for k, v in FRESH.items() if k in asked},
    )


def test_a_claim_names_the_agent_answers_it_rests_on() -> None:
    """Before (issue 11 D): a 30 s-old cached answer was claimed on; it could hide a trainer
    push (a wrong rollback target, a claim in the middle of a push). The planner knows no
    cache: it names what the claim rests on (its premise), and the reconciler applies it only
    while the agents still say it (``reconcile/confirm.py``); a pod not ours yet rests on the
    peers' precedence too."""
    p = plan(spec(maxUnavailable=1), _claimable_fleet(), Persisted(target_version="v2"), NOW)
    assert claimed(p) == ["p0"]
    assert p.premises == (Premise(("p0",), {"p0": FRESH["p0"]}, peers=True),)
    assert p.claimed_from == {"p0": PodClass.PENDING}


def test_premises_are_bounded_by_the_budget() -> None:
    p = plan(spec(maxUnavailable=3), _claimable_fleet(), Persisted(target_version="v2"), NOW)
    assert claimed(p) == ["p0", "p1"]
    assert [q.pods for q in p.premises] == [("p0",), ("p1",)]
    p = plan(spec(maxUnavailable=1), _claimable_fleet(), Persisted(target_version="v2"), NOW)
    assert [q.pods for q in p.premises] == [("p0",)]


def test_a_unit_rests_on_every_answer_of_its_pods_together() -> None:
    """A group claims together (one attempt on every pod): one premise names all its pods, so
    the caller drops the whole unit when one answer changed."""
    group = (pod("p0", unit="g"), pod("p1", unit="g"))
    p = plan(spec(maxUnavailable=1), _claimable_fleet(group), Persisted(target_version="v2"), NOW)
    assert claimed(p) == ["p0", "p1"]
    assert p.premises == (Premise(("p0", "p1"), {"p0": FRESH["p0"], "p1": FRESH["p1"]}, True),)


def test_a_retried_claim_of_a_pod_already_ours_does_not_rest_on_the_peers() -> None:
    pods = _failed_canary()
    p = run(spec(), pods, {"p0": agent("v1", ready=False, clean=False)}, RETRIED)
    assert claimed(p) == ["p0"]
    assert [(q.pods, q.peers) for q in p.premises] == [(("p0",), False)]


LATER, EARLIER = "2026-01-01T12:00:30Z", "2026-01-01T11:50:00Z"


@pytest.mark.parametrize(
    ("terminating", "expected"),
    [
        ({}, ["p0"]),
        ({"gone": LATER}, []),  # its slot is taken until it is gone
        ({"p1": LATER}, []),  # a group with a member being deleted, the rest Ready
        # still there after its grace period (a lost node): it no longer holds the rollout
        ({"gone": EARLIER}, ["p0"]),
    ],
)
def test_a_pod_being_deleted_counts_as_unavailable(
    terminating: dict[str, str], expected: list[str]
) -> None:
    """Before: a pod being deleted left the fleet and freed its slot at once, before its
    replacement (NotReady) was seen: maxUnavailable + 1 out of traffic."""
    pods = (pod("p0"), pod("p1"))
    fleet = Fleet(name="wu", owner=ME, pods=pods, agents=dict(FRESH), terminating=terminating)
    assert claimed(plan(spec(maxUnavailable=1), fleet, AT_V2, NOW)) == expected


def _claimed_long_ago(accepted: bool) -> tuple[Fleet, Persisted]:
    # claimed 20 minutes before NOW (the update timeout is 600 s); the operator started 10 s ago
    st = state(UnitState.DRAINING, started="2026-01-01T11:40:00Z", attempt=1)
    pods = (pod("p0", gate=False, ready=False, st=st),)
    update = {"phase": UpdatePhase.LOADING} if accepted else {}
    view = agent(**update)  # type: ignore[arg-type]
    if accepted:
        assert view.update is not None
        view = replace(view, update=replace(view.update, started_at="2026-01-01T11:41:00Z"))
    fleet = Fleet(name="wu", owner=ME, pods=pods, agents={"p0": view})
    return fleet, Persisted(target_version="v2", clock_floor="2026-01-01T11:59:50Z")


@pytest.mark.parametrize("accepted", [False, True])
def test_operator_downtime_does_not_count_against_the_update_timeout(accepted: bool) -> None:
    """Before: a unit claimed before the operator went down timed out at its first pass back
    (UpdateTimeout, then FailureBudgetExceeded or CanaryFailed)."""
    fleet, persisted = _claimed_long_ago(accepted)
    p = plan(spec(), fleet, persisted, NOW)
    assert not [a for a in p.actions if isinstance(a, AbortUpdate | Settle)]
    assert p.persisted.aborted_at is None
    # without the floor, the same pass times the unit out: the test sees the timer
    late = plan(spec(), fleet, replace(persisted, clock_floor=None), NOW)
    assert [a for a in late.actions if isinstance(a, Settle)]
    assert late.persisted.abort_reason == Reason.FAILURE_BUDGET_EXCEEDED


@pytest.mark.parametrize("pause_after_canary", [False, True])
def test_nothing_passes_a_canary_that_must_earn_its_verdict_again(pause_after_canary: bool) -> None:
    """The canary verified, then its vLLM restarted and is booting (not claimable): the rest
    neither starts in its place nor is held as "CanaryComplete" (found reviewing 600adc4)."""
    canary = pod("p0", gate=False, ready=False, st=state(UnitState.VERIFIED))
    pods = [canary, pod("p1"), pod("p2")]
    s = spec(maxUnavailable=3, canary=1, pauseAfterCanary=pause_after_canary)
    p = run(s, pods, {**FRESH, "p0": agent("", ready=False, clean=False)})
    assert (claimed(p), p.paused_reason) == ([], None)
    # the same after a retry of a failed canary that is booting
    p = run(s, _failed_canary(), {**FRESH, "p0": agent("", ready=False)}, RETRIED)  # type: ignore[arg-type]
    assert claimed(p) == []


def test_after_the_canary_units_start_while_others_are_in_flight() -> None:
    """Once the canary's verdict stands, a unit in flight no longer stops new starts (the
    rollout went in whole waves)."""
    pods = [
        pod("p0", st=state(UnitState.VERIFIED, started="2026-01-01T11:50:00Z")),
        pod("p1", gate=False, ready=False, st=state(UnitState.DRAINING)),
        pod("p2"),
        pod("p3"),
    ]
    p = run(spec(maxUnavailable=3, canary=1), pods, {**FRESH, "p0": agent("v2")})
    assert claimed(p) == ["p2", "p3"]


def test_a_re_claimed_canary_does_not_pass_the_canary_role_on() -> None:
    """The pass after re-claiming a canary whose engine restarted: its start time is now the
    newest, and a later, tolerated failure was taken for the canary's (CanaryFailed, and with
    onFailure: Rollback the fleet rolled back). Found reviewing 4d0fdc5."""
    again = state(UnitState.DRAINING, attempt=2, started="2026-01-01T12:00:00Z")
    failed = state(UnitState.FAILED, reason="DigestMismatch", started="2026-01-01T11:55:00Z")
    pods = [
        pod("p0", gate=False, ready=False, st=again),
        pod("p1", gate=False, ready=False, st=failed, owner=ME),
        pod("p2"),
    ]
    s = spec(maxUnavailable=3, canary=1, maxFailedReplicas=1, onFailure="Rollback")
    p = run(s, pods, {**FRESH, "p0": agent(phase=UpdatePhase.LOADING)})
    assert (p.persisted.aborted_at, p.rolling_back) == (None, False)


def test_a_canary_restarting_mid_rollout_does_not_stop_the_rollout() -> None:
    """Once units beyond the canary started, the canary phase is over: a canary whose vLLM
    restarts (booting) is one pod to update again, not a gate on the rest."""
    done = state(UnitState.VERIFIED, started="2026-01-01T11:50:00Z")
    pods = [
        pod("p0", gate=False, ready=False, st=done),  # the canary, booting again
        *(pod(f"p{i}", st=state(UnitState.VERIFIED)) for i in (1, 2, 3)),
        pod("p4"),
        pod("p5"),
    ]
    agents = {**FRESH, "p0": agent("", ready=False), **{f"p{i}": agent("v2") for i in (1, 2, 3)}}
    p = run(spec(maxUnavailable=3, canary=1), pods, agents)
    assert claimed(p) == ["p4", "p5"]


def test_pause_after_canary_holds_however_many_units_were_touched() -> None:
    """More units verified under this owner than ``canary`` (a WeightUpdate re-created under
    the same name, or ``canary`` lowered during the hold): with pauseAfterCanary only a promote
    lets the rest start (found reviewing 90036c6, which started them all)."""
    pods = [pod(f"p{i}", st=state(UnitState.VERIFIED)) for i in range(3)]
    pods += [pod("p3"), pod("p4")]
    agents = {**FRESH, **{f"p{i}": agent("v2") for i in range(3)}}
    p = run(spec(maxUnavailable=3, canary=1, pauseAfterCanary=True), pods, agents)
    assert (claimed(p), p.paused_reason) == ([], Reason.CANARY_COMPLETE)
    assert claimed(run(spec(maxUnavailable=3, canary=1), pods, agents)) == ["p3", "p4"]
