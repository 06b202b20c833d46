"""Table tests of step 1, ``classify_fleet`` (``domain/plan/classify.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from weightroll_operator.domain.model import UnitState
from weightroll_operator.domain.plan import PodClass

from tests.unit.weightroll_operator.builders import OTHER, agent, classified, pod, state


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
    _, _, seen = classified(pods, {"p0": agent("v1")})
    assert dict(seen.classes) == classes
    assert set(seen.frozen) == frozen and seen.blocked_by == blocked


def test_unit_subsets_follow_the_classes() -> None:
    """``Seen.in_flight``, ``prefetching`` and ``failing`` (what later steps walk instead of
    every unit) are exactly the units whose classes say so, in unit order."""
    pods = [
        pod("a", gate=False, ready=False, st=state()),
        pod("b"),
        pod("c", st=state(UnitState.PREFETCHING)),
        pod("d", gate=False, ready=False, st=state(UnitState.FAILED)),
        pod("e", gate=False, ready=False, st=state(), unit="g"),
        pod("f", unit="g"),
    ]
    _, _, seen = classified(pods, {n: agent("v1") for n in "abcdef"})

    def having(*classes: PodClass) -> list[str]:
        return [u.key for u in seen.units if not seen.by_unit[u.key].isdisjoint(classes)]

    assert [u.key for u in seen.in_flight] == having(PodClass.IN_FLIGHT) == ["a", "g"]
    assert [u.key for u in seen.prefetching] == having(PodClass.PREFETCHING) == ["c"]
    assert sorted(seen.failing) == having(PodClass.FAILED, PodClass.ROLLBACK_FAILED) == ["d"]
