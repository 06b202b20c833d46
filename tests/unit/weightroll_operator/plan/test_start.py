"""Table tests of step 4, ``budget``, and of what one claim of step 5b costs
(``domain/plan/start.py``, ``domain/availability.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from weightroll_operator.domain.model import PodView, UnitState
from weightroll_operator.domain.plan.start import budget

from tests.unit.weightroll_operator.builders import ME, classified, pod, state


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
    _, _, seen = classified(pods, maxUnavailable=max_unavailable)
    assert budget(seen, frozenset(flying)) == slots


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
