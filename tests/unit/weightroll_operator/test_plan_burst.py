"""The burst limit (``plan``'s ``step_limit``, ``OperatorConfig.burst``), table-driven.

A pass starts forward steps (claims, update starts, completions, restores) on at most
``step_limit`` pods and says it left some (``Plan.deferred``: the next pass follows at once);
a unit is never split, and steps that keep traffic safe (drains, aborts, failures) are never
held back. Without a limit the plan is what it always was.
"""

from __future__ import annotations

import pytest
from weightroll_operator.domain.conditions import Reason

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import agent, pod, run, spec, state, summary

FRESH = {f"p{i}": agent("v1") for i in range(6)}
COMMITTED = agent("v2", phase=UpdatePhase.COMMITTED)


def _of(p: object, kind: str) -> list[str]:
    return [n for t, n in summary(p) if t == kind]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step_limit", "claimed", "deferred"),
    [
        (None, ["p0", "p1", "p2", "p3", "p4"], False),
        (5, ["p0", "p1", "p2", "p3", "p4"], False),  # exactly used up: nothing left over
        (2, ["p0", "p1"], True),
        (1, ["p0"], True),
        (0, ["p0"], True),  # at least one pod per pass
    ],
)
def test_claims_stop_at_the_limit(
    step_limit: int | None, claimed: list[str], deferred: bool
) -> None:
    pods = [pod(f"p{i}") for i in range(5)]
    p = run(spec(maxUnavailable="100%"), pods, FRESH, step_limit=step_limit)
    assert _of(p, "Claim") == claimed
    assert _of(p, "GateOff") == claimed  # every claim still drains its pod
    assert p.deferred is deferred
    assert p.pending_units == 5 - len(claimed)


def test_a_group_larger_than_the_limit_still_goes_whole_and_first() -> None:
    pods = [pod(f"p{i}", unit="g0") for i in range(3)] + [pod("p3", unit="g1")]
    p = run(spec(maxUnavailable="100%"), pods, FRESH, step_limit=2)
    assert _of(p, "Claim") == ["p0", "p1", "p2"]  # never split; g1 waits
    assert p.deferred


@pytest.mark.parametrize(
    ("step_limit", "completed", "deferred"),
    [(None, ["p0", "p1", "p2"], False), (2, ["p0", "p1"], True), (1, ["p0"], True)],
)
def test_completions_stop_at_the_limit_and_the_rest_stay_in_flight(
    step_limit: int | None, completed: list[str], deferred: bool
) -> None:
    pods = [pod(f"p{i}", gate=False, ready=False, st=state()) for i in range(3)]
    agents = {f"p{i}": COMMITTED for i in range(3)}
    p = run(spec(maxUnavailable=3), pods, agents, step_limit=step_limit)
    assert _of(p, "GateOn") == completed and _of(p, "Settle") == completed
    assert p.deferred is deferred
    assert p.in_flight_units == 3 - len(completed)
    assert not p.completed if deferred else p.completed
    assert sorted(p.finished) == completed  # only the completed ones finished this pass
    (verified,) = [a for a in p.actions if getattr(a, "reason", "") == Reason.UNIT_VERIFIED]
    assert verified.pods == tuple(completed)  # type: ignore[attr-defined]


def test_update_starts_stop_at_the_limit() -> None:
    pods = [pod(f"p{i}", gate=False, ready=False, st=state()) for i in range(3)]
    p = run(spec(maxUnavailable=3), pods, {f"p{i}": agent() for i in range(3)}, step_limit=2)
    assert _of(p, "StartUpdate") == ["p0", "p1"]
    assert p.deferred


def test_drains_aborts_and_failures_are_never_held_back() -> None:
    """With the limit spent on p0's completion: p1's lost drain is written again, p2's
    timed-out update is aborted and failed, p3's failed verdict is settled."""
    pods = [
        pod("p0", gate=False, ready=False, st=state()),
        pod("p1", gate=True, ready=True, st=state()),
        pod("p2", gate=False, ready=False, st=state(started="2026-01-01T11:00:00Z")),
        pod("p3", gate=False, ready=False, st=state()),
    ]
    agents = {
        "p0": COMMITTED,
        "p1": agent(),
        "p2": agent(phase=UpdatePhase.LOADING),
        "p3": agent(phase=UpdatePhase.FAILED, reasons=["digest mismatch"]),
    }
    s = spec(maxUnavailable=4, updateTimeoutSeconds=120, maxFailedReplicas=4)
    p = run(s, pods, agents, step_limit=1)
    assert _of(p, "GateOn") == ["p0"]
    assert _of(p, "GateOff") == ["p1"]
    assert _of(p, "AbortUpdate") == ["p2"]
    assert _of(p, "Settle") == ["p0", "p2", "p3"]
    assert set(p.reasons) == {"p2", "p3"}


def test_restores_stop_at_the_limit() -> None:
    """Pods already serving the target with the gate off (new pods) get it back, a few a pass."""
    pods = [pod(f"p{i}", gate=False, ready=False) for i in range(3)]
    serving = {f"p{i}": agent("v2") for i in range(3)}
    p = run(spec(), pods, serving, step_limit=2)
    assert _of(p, "GateOn") == ["p0", "p1"]
    assert p.deferred
    assert _of(run(spec(), pods, serving), "GateOn") == ["p0", "p1", "p2"]


@pytest.mark.parametrize(("units", "claimed"), [(40 * 3 - 1, 2), (40 * 3, 3), (40 * 5, 5)])
def test_the_limit_grows_with_the_fleet(units: int, claimed: int) -> None:
    """A pass walks every pod anyway: it starts steps on at least one ``STEP_SHARE``-th (40th)
    of the units, so a batch takes as many passes at 100,000 pods as at 10,000 (issue 27 C)."""
    pods = [pod(f"p{i:03d}") for i in range(units)]
    agents = {f"p{i:03d}": agent("v1") for i in range(units)}
    p = run(spec(maxUnavailable="100%"), pods, agents, step_limit=2)
    assert _of(p, "Claim") == [f"p{i:03d}" for i in range(claimed)]
    assert p.deferred
