"""Table tests of step 3, ``deadlines`` (``domain/plan/deadlines.py``)."""

from __future__ import annotations

import pytest
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import PodView, UnitState
from weightroll_operator.domain.plan import Fleet, Persisted
from weightroll_operator.domain.plan.classify import classify_fleet
from weightroll_operator.domain.plan.context import PassContext
from weightroll_operator.domain.plan.deadlines import deadlines

from tests.unit.weightroll_operator.builders import ME, NOW, V2, agent, pod, spec, state

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
        # a rollback from v2 on a pod while the status says nothing of a halt (lost with an
        # operator stopped before its status write, or by spec.version leaving v2 and coming
        # back): the halt is read off the pod (``domain.halts``)
        (
            V2,
            {},
            [pod("p0", st=state(UnitState.ROLLED_BACK, version="v1", rollback_of="v2")), pod("p1")],
            Reason.ROLLBACK_RECORDED,
        ),
        # ... unless `weightroll retry` came after it
        (
            Persisted(target_version="v2", retried_at="2026-01-01T11:59:30Z"),
            {},
            [pod("p0", st=state(UnitState.ROLLED_BACK, version="v1", rollback_of="v2")), pod("p1")],
            None,
        ),
        # a rollback from another version is no halt of this one
        (
            V2,
            {},
            [pod("p0", st=state(UnitState.ROLLED_BACK, version="v1", rollback_of="v3")), pod("p1")],
            None,
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
    b = PassContext(s, fleet, NOW)
    halt = deadlines(b, seen, persisted, frozenset())
    assert halt.abort_reason == reason
    assert (halt.aborted_at is not None) is (reason is not None)
