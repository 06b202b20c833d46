"""Table tests of the named steps of ``plan()`` (``domain/plan.py``), one table per step."""

from __future__ import annotations

from dataclasses import replace

import pytest
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import PodView, UnitState
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    PodClass,
    _Builder,
    advance_units,
    budget,
    classify_fleet,
    deadlines,
)

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import ME, NOW, OTHER, agent, pod, spec, state

V2 = Persisted(target_version="v2")


def _seen(pods: list[object], agents: dict[str, object] | None = None, **strategy: object):  # type: ignore[no-untyped-def]
    s = spec(**strategy)
    fleet = Fleet(name="wu", owner=ME, pods=tuple(pods), agents=agents or {})  # type: ignore[arg-type]
    return s, fleet, classify_fleet(s, fleet, V2)


@pytest.mark.parametrize(
    ("pods", "classes", "frozen", "blocked"),
    [
        ([pod("p0")], {"p0": PodClass.PENDING}, set(), ()),
        # verified at v2, but its agent serves v1 now: pending again
        ([pod("p0", st=state(UnitState.VERIFIED))], {"p0": PodClass.PENDING}, set(), ()),
        ([pod("p0", gate=False, ready=False, st=state())], {"p0": PodClass.IN_FLIGHT}, set(), ()),
        ([pod("p0", owner=OTHER)], {"p0": PodClass.BLOCKED}, set(), (OTHER,)),
        ([replace(pod("p0"), stale=True)], {"p0": PodClass.PENDING}, {"p0"}, ()),
    ],
)
def test_classify_fleet(
    pods: list[object], classes: dict[str, PodClass], frozen: set[str], blocked: tuple[str, ...]
) -> None:
    _, _, seen = _seen(pods, {"p0": agent("v1")})
    assert dict(seen.classes) == classes
    assert set(seen.frozen) == frozen and seen.blocked_by == blocked


@pytest.mark.parametrize(
    ("pods", "flying", "max_unavailable", "slots"),
    [
        ([pod("p0"), pod("p1")], set(), 1, 1),
        ([pod("p0", ready=False), pod("p1")], set(), 1, 0),  # not Ready: unavailable
        ([pod("p0", gate=False, ready=False, st=state()), pod("p1")], {"p0"}, 2, 1),
        # gate back on but kubelet has not reported Ready yet: still unavailable
        ([pod("p0", gate=True, ready=False, st=state(UnitState.VERIFIED)), pod("p1")], set(), 1, 0),
        ([replace(pod("p0"), stale=True), pod("p1")], set(), 1, 0),  # seen before our write
        (
            [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME), pod("p1")],
            set(),
            2,
            1,
        ),
    ],
)
def test_budget(pods: list[object], flying: set[str], max_unavailable: int, slots: int) -> None:
    _, _, seen = _seen(pods, maxUnavailable=max_unavailable)
    assert budget(seen, frozenset(flying)) == slots


def test_advance_units_moves_in_flight_units_and_skips_frozen_ones() -> None:
    draining = pod("p0", gate=False, ready=False, st=state())
    running = {"p0": agent(phase=UpdatePhase.LOADING)}
    s, fleet, seen = _seen([draining], running)
    b = _Builder(s, fleet, NOW)
    assert advance_units(b, seen) == {"p0"} and b.actions == []
    s, fleet, seen = _seen([draining], {"p0": agent(phase=UpdatePhase.COMMITTED)})
    b = _Builder(s, fleet, NOW)
    assert advance_units(b, seen) == frozenset() and b.finished == {"p0": "succeeded"}
    s, fleet, seen = _seen(
        [replace(draining, stale=True)], {"p0": agent(phase=UpdatePhase.COMMITTED)}
    )
    b = _Builder(s, fleet, NOW)
    assert advance_units(b, seen) == {"p0"} and b.actions == []  # frozen: no step


LONG_AGO = "2026-01-01T08:00:00Z"


@pytest.mark.parametrize(
    ("persisted", "strategy", "pods", "reason"),
    [
        # no progress for hours, work left: halted
        (
            Persisted(target_version="v2", last_progress_time=LONG_AGO),
            {"progressDeadlineSeconds": 60},
            [pod("p0")],
            Reason.PROGRESS_DEADLINE_EXCEEDED,
        ),
        # ... unless the operator started a moment ago (its downtime does not count)
        (
            Persisted(
                target_version="v2", last_progress_time=LONG_AGO, clock_floor="2026-01-01T11:59:50Z"
            ),
            {"progressDeadlineSeconds": 60},
            [pod("p0")],
            None,
        ),
        # ... or a retry restarted the clock
        (
            Persisted(
                target_version="v2", last_progress_time=LONG_AGO, retried_at="2026-01-01T11:59:50Z"
            ),
            {"progressDeadlineSeconds": 60},
            [pod("p0")],
            None,
        ),
        # a failed unit beyond the budget
        (
            V2,
            {"maxFailedReplicas": 0},
            [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME)],
            Reason.FAILURE_BUDGET_EXCEEDED,
        ),
        # a failed canary, within the budget
        (
            V2,
            {"maxFailedReplicas": 5, "canary": 1},
            [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME), pod("p1")],
            Reason.CANARY_FAILED,
        ),
        # already halted: kept
        (
            Persisted(target_version="v2", aborted_at="x", abort_reason=Reason.ABORTED_BY_USER),
            {},
            [pod("p0")],
            Reason.ABORTED_BY_USER,
        ),
    ],
)
def test_deadlines(
    persisted: Persisted, strategy: dict[str, object], pods: list[PodView], reason: str | None
) -> None:
    s = spec(**strategy)
    fleet = Fleet(
        name="wu", owner=ME, pods=tuple(pods), agents={"p0": agent("v1"), "p1": agent("v1")}
    )
    seen = classify_fleet(s, fleet, persisted)
    b = _Builder(s, fleet, NOW)
    halt = deadlines(b, seen, persisted, frozenset())
    assert halt.abort_reason == reason
    assert (halt.aborted_at is not None) is (reason is not None)


@pytest.mark.parametrize(
    ("unit_pods", "cost"),
    [
        ([pod("p0")], 2),  # Ready: one more unit out of traffic
        ([pod("p0", ready=False)], 1),  # a blip: only the rollout's own budget
        ([pod("p0", gate=False, ready=False)], 0),  # held out by our gate: free
        ([pod("p0", gate=None, ready=False)], 0),  # a new pod, not admitted yet: free
        # a group with one member in traffic: its claim drains that member
        ([pod("a", unit="g", gate=False, ready=False), pod("b", unit="g", ready=False)], 1),
    ],
)
def test_what_a_claim_costs(unit_pods: list[PodView], cost: int) -> None:
    """``domain.availability``: a claim keeps its unit out for the whole reload (item 2)."""
    from weightroll_operator.domain.availability import Slots
    from weightroll_operator.domain.fleet import Unit

    unit = Unit(unit_pods[0].unit, tuple(unit_pods))
    assert Slots(fleet=0, rollout=1).cost(unit) == cost
    # no slot of the rollout's own: only a free claim goes
    assert Slots(fleet=5, rollout=0).affords(unit) is (cost == 0)
    # fleet budget spent by units down for other reasons: a Ready unit waits, a blip does not
    assert Slots(fleet=0, rollout=1).affords(unit) is (cost < 2)
