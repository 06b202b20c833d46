"""Greedy step deletion (``tests/harness/sim/schedule.py``), on schedules whose failure is a
known function of their steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from tests.harness.sim.schedule import Step, recorded, render, shrink

pytestmark = pytest.mark.sim


def _steps(*rules: str) -> list[Step]:
    return [Step(r, ()) for r in rules]


def _needs(*wanted: str) -> tuple[list[int], Callable[[Sequence[Step]], bool]]:
    """A predicate that fails while ``wanted`` occur in order (a subsequence); it counts its
    calls in the returned list."""
    calls = [0]

    def fails(steps: Sequence[Step]) -> bool:
        calls[0] += 1
        it = iter(s.rule for s in steps)
        return all(w in it for w in wanted)

    return calls, fails


def test_greedy_deletion_leaves_only_the_steps_the_failure_needs() -> None:
    noise = [f"n{i}" for i in range(30)]
    steps = _steps("start", *noise[:10], "a", *noise[10:20], "b", "a", *noise[20:], "c")
    _, fails = _needs("a", "b", "c")
    shrunk = shrink(steps, fails)
    assert [s.rule for s in shrunk] == ["start", "a", "b", "c"]
    # 1-minimal: no single deletion fails any more (the first step is kept as the start)
    for i in range(1, len(shrunk)):
        assert not fails(shrunk[:i] + shrunk[i + 1 :])


def test_the_start_is_kept_and_the_budget_bounds_the_replays() -> None:
    steps = _steps("start", *(f"n{i}" for i in range(40)), "a")
    calls, fails = _needs("a")
    assert [s.rule for s in shrink(steps, fails)] == ["start", "a"]
    calls[0] = 0
    bounded = shrink(steps, fails, budget=3)
    assert calls[0] == 3 and len(bounded) < len(steps) and bounded[-1].rule == "a"


class _Counter(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.schedule: list[Step] = []

    @initialize()
    @recorded
    def begin(self) -> None:
        pass

    @rule(by=st.integers(1, 3))
    @recorded
    def add(self, by: int) -> None:
        pass


def test_recorded_rules_render_as_replayable_calls() -> None:
    machine = _Counter()
    machine.begin()
    machine.add(by=2)
    machine.add(3)  # a hand-written replay may pass arguments by position
    assert machine.schedule == [
        Step("begin", ()),
        Step("add", (("by", 2),)),
        Step("add", (("by", 3),)),
    ]
    assert render(machine.schedule, "what failed").splitlines() == [
        "# what failed",
        "sim.begin()",
        "sim.add(by=2)",
        "sim.add(by=3)",
    ]
