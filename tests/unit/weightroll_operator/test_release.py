"""Table tests of what deleting a WeightUpdate does to its pods (``domain/release.py``)."""

from __future__ import annotations

import pytest
from weightroll_operator.domain.actions import AbortUpdate, Emit, GateOn, Settle
from weightroll_operator.domain.gate_vouch import GateVouch
from weightroll_operator.domain.model import AgentView, UnitState
from weightroll_operator.domain.release import deleted_owner, release

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import ME, OTHER, agent, pod, state

DRAINING = state()


def _kinds(r: object) -> list[str]:
    return [type(a).__name__ for a in r.actions if not isinstance(a, Emit)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("view", "kinds", "outcome"),
    [
        # the attempt committed and the ranks serve it (aborting it would answer 409)
        (agent(phase=UpdatePhase.COMMITTED), ["GateOn", "Settle"], "restored"),
        # still running: abort it, keep the pod until the verdict
        (agent(phase=UpdatePhase.LOADING), ["AbortUpdate"], "pending"),
        # aborted or failed: the agent holds the replica -> released, left drained
        (agent(phase=UpdatePhase.ABORTED, ready=False, clean=False), ["Settle"], "left"),
        (agent(phase=UpdatePhase.FAILED, ready=False), ["Settle"], "left"),
        # never started (the agent does not know the id) and ready at v1: traffic back
        (agent("v1"), ["GateOn", "Settle"], "restored"),
        # unreachable while the update may run: not released (the finalizer stays)
        (AgentView(reachable=False, error="refused"), [], "pending"),
        (AgentView(reachable=False, error="401 unauthorized"), [], "pending"),
    ],
)
def test_release_of_an_in_flight_pod(view: AgentView, kinds: list[str], outcome: str) -> None:
    p = pod("p0", gate=False, ready=False, st=DRAINING)
    r = release([p], {"p0": view}, ME)
    assert _kinds(r) == kinds
    assert ("p0" in r.restored, "p0" in r.left_drained, "p0" in r.pending) == (
        outcome == "restored",
        outcome == "left",
        outcome == "pending",
    )
    for a in r.actions:
        if isinstance(a, Settle):
            assert a.release and a.state.by == deleted_owner(ME)
        if isinstance(a, GateOn):
            assert a.version == view.version
        if isinstance(a, AbortUpdate):
            assert a.update_id == DRAINING.update_id
    if outcome == "left":
        assert r.drained_since["p0"] > 0
        assert any(isinstance(a, Emit) and a.reason == "LeftDrained" for a in r.actions)
    if outcome == "pending":
        assert any(isinstance(a, Emit) and a.reason == "ReleasePending" for a in r.actions)


def test_restored_pod_records_what_it_serves() -> None:
    p = pod("p0", gate=False, ready=False, st=DRAINING)
    r = release([p], {"p0": agent("v1")}, ME)
    settle = next(a for a in r.actions if isinstance(a, Settle))
    assert (settle.state.state, settle.state.version) == (UnitState.ROLLED_BACK, "v1")
    r = release([p], {"p0": agent(phase=UpdatePhase.COMMITTED)}, ME)
    settle = next(a for a in r.actions if isinstance(a, Settle))
    assert (settle.state.state, settle.state.version) == (UnitState.VERIFIED, "v2")


def test_a_restored_pod_records_what_its_gate_vouches_for() -> None:
    """Like every GateOn of ours (``domain.gate_vouch``): the claim kept the vouch of the gate
    it took off (v1), and the released record said the gate set for v2 vouched for v1."""
    claimed = state(gate=GateVouch("v1", None, "uid|ip|0"))
    p = pod("p0", gate=False, ready=False, st=claimed)
    r = release([p], {"p0": agent(phase=UpdatePhase.COMMITTED)}, ME)
    settle = next(a for a in r.actions if isinstance(a, Settle))
    assert settle.state.gate == GateVouch("v2", "wu-v2", None)


def test_a_failed_pod_whose_agent_is_held_stays_drained_and_only_owned_pods_are_touched() -> None:
    failed = pod("p0", gate=False, ready=False, st=state(UnitState.FAILED), owner=ME)
    foreign = pod("p1", gate=False, ready=False, st=state(by=OTHER), owner=OTHER)
    released = pod("p2", st=state(UnitState.VERIFIED))  # not owned any more
    r = release([failed, foreign, released], {"p0": agent("v1", ready=False)}, ME)
    assert r.released == ("p0",) and list(r.left_drained) == ["p0"]
    assert all(a.pod.name == "p0" for a in r.actions if not isinstance(a, Emit))  # type: ignore[attr-defined]
