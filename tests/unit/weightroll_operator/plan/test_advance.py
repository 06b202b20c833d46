"""Table tests of step 2, ``advance_units`` (``domain/plan/advance.py``)."""

from __future__ import annotations

from dataclasses import replace

from weightroll_operator.domain.plan.advance import advance_units
from weightroll_operator.domain.plan.context import PassContext

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import NOW, agent, classified, pod, state


def test_advance_units_moves_in_flight_units_and_skips_frozen_ones() -> None:
    draining = pod("p0", gate=False, ready=False, st=state())
    running = {"p0": agent(phase=UpdatePhase.LOADING)}
    s, fleet, seen = classified([draining], running)
    b = PassContext(s, fleet, NOW)
    assert advance_units(b, seen) == {"p0"} and b.actions == []
    s, fleet, seen = classified([draining], {"p0": agent(phase=UpdatePhase.COMMITTED)})
    b = PassContext(s, fleet, NOW)
    assert advance_units(b, seen) == frozenset() and b.finished == {"p0": "succeeded"}
    s, fleet, seen = classified(
        [replace(draining, stale=True)], {"p0": agent(phase=UpdatePhase.COMMITTED)}
    )
    b = PassContext(s, fleet, NOW)
    assert advance_units(b, seen) == {"p0"} and b.actions == []  # frozen: no step
