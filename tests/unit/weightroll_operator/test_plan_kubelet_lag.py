"""A claim waits for the kubelet to act on our last gate write (``plan.start.kubelet_caught_up``).

Found on the real node: a pod restored at v3 (``GateOn``) was claimed for v2 a moment later
(the spec flipped back), its ``Ready`` still False from before the ``GateOn`` read as the drain,
and the update started; the kubelet's ``Ready`` True for the gate True it had seen then landed,
and the Service sent traffic to a pod inside its update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from weightroll_operator.domain.actions import Claim, GateOff
from weightroll_operator.domain.fleet import pod_view
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY, UnitState

from tests.unit.weightroll_operator.builders import agent, pod, run, spec, state


def _pod_object(**conditions: bool) -> dict[str, Any]:
    return {
        "metadata": {"name": "p0", "namespace": "ns", "uid": "u0", "resourceVersion": "7"},
        "spec": {
            "readinessGates": [{"conditionType": CONDITION_WEIGHTS_READY}, {"conditionType": "lb"}],
            "containers": [],
        },
        "status": {
            "conditions": [
                {"type": t, "status": "True" if v else "False"} for t, v in conditions.items()
            ]
        },
    }


@pytest.mark.parametrize(
    ("lb", "containers", "ready", "lags"),
    [
        (True, True, False, True),  # every input of kubelet's rule True, Ready not yet
        (True, True, True, False),  # caught up
        (False, True, False, False),  # another gate explains Ready False
        (True, False, False, False),  # the containers explain it
    ],
)
def test_ready_lags_the_gates_only_when_nothing_explains_it(
    lb: bool, containers: bool, ready: bool, lags: bool
) -> None:
    obj = _pod_object(
        **{CONDITION_WEIGHTS_READY: True, "lb": lb, "ContainersReady": containers, "Ready": ready}
    )
    assert pod_view(obj, group_by=None).ready_lags_gates is lags


def _restored_at_v1(lagging: bool) -> list[Any]:
    # verified at v1 by an earlier rollout, its gate just set True; the spec now wants v2
    p0 = pod("p0", ready=not lagging, gate=True, st=state(UnitState.VERIFIED, version="v1"))
    p0 = dataclasses.replace(p0, containers_ready=True, ready_lags_gates=lagging)
    return [p0, pod("p1", ready=True, gate=True)]


@pytest.mark.parametrize("max_unavailable", [1, 2])
def test_a_pod_whose_ready_lags_our_gate_on_is_not_claimed(max_unavailable: int) -> None:
    agents = {"p0": agent("v1"), "p1": agent("v1")}
    p = run(spec(maxUnavailable=max_unavailable), _restored_at_v1(lagging=True), agents)
    claimed = {a.pod.name for a in p.actions if isinstance(a, Claim | GateOff)}
    assert "p0" not in claimed
    # the budget it costs meanwhile is spent on nobody else: it is out of traffic already
    if max_unavailable == 1:
        assert claimed == set()


def test_once_the_kubelet_caught_up_the_pod_is_claimed_and_drained() -> None:
    agents = {"p0": agent("v1"), "p1": agent("v1")}
    p = run(spec(maxUnavailable=1), _restored_at_v1(lagging=False), agents)
    assert any(isinstance(a, Claim) and a.pod.name == "p0" for a in p.actions)
    assert any(isinstance(a, GateOff) and a.pod.name == "p0" for a in p.actions)
