"""``spec.strategy.prefetch`` (issue 30): passed through to the agent's ``prefetch``.

The operator schedules nothing around it (the pod is gated out before the agent is asked); it
carries the field on the wire, and refuses at the door what the agent would refuse.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from weightroll_operator.api.v1alpha1 import parse_spec
from weightroll_operator.domain.model import UnitState, WeightState
from weightroll_operator.domain.plan import build_request
from weightroll_operator.webhook import validate

from engine_agent.protocol import PrefetchMode
from tests.unit.weightroll_operator.builders import state

GOOD: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "llm"}},
    "version": "v2",
    "source": {"uri": "file:///models/v2"},
}


def _spec(**strategy: Any) -> dict[str, Any]:
    new = copy.deepcopy(GOOD)
    new["strategy"] = strategy
    return new


def _request(spec_dict: dict[str, Any], *, rollback: bool = False) -> dict[str, Any]:
    probe = WeightState(state=UnitState.DRAINING, by=state().by, version="v2", update_id="wu-v2")
    if rollback:
        from weightroll_operator.domain.model import SourceRef

        probe = WeightState(
            state=UnitState.ROLLING_BACK,
            by=state().by,
            version="v1",
            update_id="wu-v1-rb",
            previous_source=SourceRef(uri="file:///models/v1"),
        )
    request = build_request(parse_spec(spec_dict), probe, rollback=rollback)
    wire: dict[str, Any] = request.to_wire()
    return wire


def test_no_prefetch_by_default() -> None:
    assert _request(GOOD)["prefetch"] == {
        "mode": "None",
        "maxBytes": None,
        "awaitSwap": False,
        "swapDeadlineSeconds": 600,
    }


@pytest.mark.parametrize("rollback", [False, True])
def test_prefetch_is_carried_to_the_agent(rollback: bool) -> None:
    spec_dict = _spec(prefetch={"mode": "Host", "maxBytes": 1 << 30})
    assert validate({"spec": spec_dict}, None) is None
    spec_dict["strategy"]["updateTimeoutSeconds"] = 900
    assert validate({"spec": spec_dict}, None) is None
    # with Host the operator gives the go once it drained the pod (SwapUpdate): the agent
    # parks in Prefetched until then, no longer than the unit's update timeout
    assert _request(spec_dict, rollback=rollback)["prefetch"] == {
        "mode": PrefetchMode.HOST.value,
        "maxBytes": 1 << 30,
        "awaitSwap": True,
        "swapDeadlineSeconds": 900,
    }


def test_max_concurrent_prefetches_need_host() -> None:
    spec_dict = _spec(prefetch={"maxConcurrent": 3})
    problem = validate({"spec": spec_dict}, None)
    assert problem is not None and problem.startswith("spec.strategy.prefetch.maxConcurrent: ")
    assert validate({"spec": _spec(prefetch={"mode": "Host", "maxConcurrent": 3})}, None) is None


def test_prefetch_of_a_sparse_source_is_refused_naming_the_field() -> None:
    spec_dict = _spec(prefetch={"mode": "Host"})
    spec_dict["source"] |= {"mode": "sparse", "baseVersion": "v1"}
    problem = validate({"spec": spec_dict}, None)
    assert problem is not None and problem.startswith("spec.strategy.prefetch.mode: "), problem


@pytest.mark.parametrize(
    "bad",
    [{"mode": "Disk"}, {"mode": "Host", "maxBytes": 0}, {"mode": "Host", "maxConcurrent": 0}],
)
def test_a_malformed_prefetch_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="prefetch"):
        parse_spec(_spec(prefetch=bad))
