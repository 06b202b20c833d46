"""Every gate the planner sets True records what it vouches for with it (``domain.gate_vouch``),
table-tested per path that sets it; and the next pass judges a pod by that record.

Before, only a verdict (``Verified``) and a withdrawal wrote the vouch. A pod restored with no
record of ours, or with a ``Failed``/``RolledBack`` record (retried), or one given the
rollback's target, kept none: no later pass judged its gate, and once its containers restarted
onto other weights it served them in traffic under the gate set for the version. Fails on
48cc234."""

from __future__ import annotations

import dataclasses

import pytest
from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.domain.actions import Claim, GateOff, GateOn, Settle
from weightroll_operator.domain.conditions import timestamp
from weightroll_operator.domain.gate_vouch import GateVouch
from weightroll_operator.domain.model import AgentView, PodView, UnitState, WeightState
from weightroll_operator.domain.plan import Persisted, PodClass
from weightroll_operator.domain.pod_events import pod_event

from tests.unit.weightroll_operator.builders import (
    ME,
    NOW,
    OTHER,
    V1_SRC,
    agent,
    pod,
    run,
    spec,
    state,
)

HERE = "uid|10.0.0.1|0"
#: The same pod after its containers restarted.
RESTARTED = "uid|10.0.0.1|1"
DONE = Persisted(target_version="v2", completion_time="2026-01-01T11:00:00Z")
RETRIED = Persisted(target_version="v2", retried_at="2026-01-01T11:59:30Z")
HALTED = Persisted(target_version="v2", aborted_at=timestamp(NOW), abort_reason="X")
ROLLBACK = spec(maxUnavailable=1, onFailure="Rollback")
#: A verified pod beside the one under test (a finished fleet, or the rollback's unit).
VERIFIED = pod("p0", st=state(UnitState.VERIFIED))
V2 = agent("v2", committed_update_id="wu-v2")


def _at(p: PodView, incarnation: str, **changes: object) -> PodView:
    return dataclasses.replace(p, incarnation=incarnation, **changes)  # type: ignore[arg-type]


# (case, spec, the pod under test "p1", its agent, what the pass persisted, the gate's reason,
#  the record it keeps (None: a new one, Attested), and the vouch it records)
CASES = [
    (
        "no record: a new pod already at the target",
        spec(),
        _at(pod("p1", ready=False, gate=None), HERE),
        agent("v2"),
        DONE,
        "ServingTarget",
        None,
        GateVouch("v2", None, HERE),
    ),
    (
        "a failed attempt retried, the pod serving the target",
        spec(),
        _at(pod("p1", ready=False, gate=False, owner=ME, st=state(UnitState.FAILED)), HERE),
        V2,
        RETRIED,
        "ServingTarget",
        UnitState.FAILED,
        GateVouch("v2", "wu-v2", HERE),
    ),
    (
        # rolled back from v3 to v2, the spec back at v2; its gate taken off since (drained
        # while its agent did not answer), now answering at v2
        "a rollback's record at the target",
        spec(),
        _at(
            pod("p1", ready=False, gate=False, st=state(UnitState.ROLLED_BACK, rollback_of="v3")),
            HERE,
        ),
        V2,
        DONE,
        "ServingTarget",
        UnitState.ROLLED_BACK,
        GateVouch("v2", "wu-v2", HERE),
    ),
    (
        "no record: a new pod serving the rollback's target",
        ROLLBACK,
        _at(pod("p1", ready=False, gate=None), HERE),
        agent("v1", source=V1_SRC),
        HALTED,
        "ServingRollbackTarget",
        None,
        GateVouch("v1", None, HERE),
    ),
]


@pytest.mark.parametrize(
    ("s", "p1", "live", "persisted", "reason", "kept", "vouch"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_gate_set_true_records_what_it_vouches_for(
    s: WeightUpdateSpec,
    p1: PodView,
    live: AgentView,
    persisted: Persisted,
    reason: str,
    kept: UnitState | None,
    vouch: GateVouch,
) -> None:
    p = run(s, [VERIFIED, p1], {"p0": V2, "p1": live}, persisted)
    gates = [(a.pod.name, a.reason) for a in p.actions if isinstance(a, GateOn)]
    assert gates == [("p1", reason)]
    [record] = [a for a in p.actions if isinstance(a, Settle) and a.pod.name == "p1"]
    assert record.state.gate == vouch
    assert not record.release  # the vouch changes nothing else: an owned pod stays owned
    if kept is None:
        assert record.state.state is UnitState.ATTESTED
        assert (record.state.by, record.state.version) == (ME, vouch.version)
        assert not record.state.attempted_by(ME)  # no rollback target, no canary
    else:
        assert p1.state is not None
        assert record.state == p1.state.evolve(gate=vouch)
        # a failure record keeping its state is no new failure: no Event, no failure counted
        assert not record.transition and pod_event(record, ME) is None
    if reason == "ServingTarget":
        assert p.classes["p1"].value == "Updated"  # restored, whatever the record's state


def _written(
    p1: PodView, persisted: Persisted, s: WeightUpdateSpec, live: AgentView
) -> WeightState | None:
    """The record of ``p1`` after the pass that restores it landed."""
    p = run(s, [VERIFIED, p1], {"p0": V2, "p1": live}, persisted)
    records = [a.state for a in p.actions if isinstance(a, Settle) and a.pod.name == "p1"]
    return records[-1] if records else p1.state


@pytest.mark.parametrize(
    ("case", "reachable", "expected"),
    [
        # its containers restarted onto the boot weights v1, the agent answers: re-attested
        (0, True, ("GateOn", "v1")),
        (1, True, ("GateOn", "v1")),
        (2, True, ("GateOn", "v1")),
        # ... and it does not answer: nothing says what they serve, the gate goes off
        (0, False, ("GateOff", None)),
        (1, False, ("GateOff", None)),
        (2, False, ("GateOff", None)),
        # the rollback's target was the boot weights: the same weights, the vouch stands
        (3, True, None),
        (3, False, ("GateOff", None)),
    ],
)
def test_the_next_pass_judges_the_gate_by_its_record(
    case: int, reachable: bool, expected: tuple[str, str | None] | None
) -> None:
    """The pod of ``CASES[case]`` after its gate landed: its containers restart onto the boot
    weights v1 while every slot of the budget is held; the gate set for v2 is judged on the
    record's vouch (on 48cc234 nothing judged it: the pod served v1 in traffic)."""
    _, s, p1, live, persisted, *_ = CASES[case]
    record = _written(p1, persisted, s, live)
    after = _at(p1, RESTARTED, state=record, gate=True, ready=True, owner=p1.owner)
    busy = pod("p2", gate=False, ready=False, st=state(UnitState.DRAINING, update_id="wu-v2-b"))
    if reachable:
        now = agent("v1", source=V1_SRC)
    else:
        now = AgentView(reachable=False, error="connection refused")
    answers = {"p0": V2, "p1": now, "p2": agent("v1", ready=False)}
    p = run(spec(maxUnavailable=1), [VERIFIED, after, busy], answers, persisted)
    acted = [a for a in p.actions if isinstance(a, GateOn | GateOff) and a.pod.name == "p1"]
    assert [(type(a).__name__, getattr(a, "version", None)) for a in acted] == (
        [expected] if expected else []
    )


def test_another_finished_update_still_converges_a_pod_we_only_attested() -> None:
    """An ``Attested`` record says only what our gate vouched for, not that an attempt of ours
    took the pod: a finished WeightUpdate that wants the pod at another version claims it, as it
    claimed the pod before the record existed (a new pod after both rollouts finished must
    converge to the one that has precedence, issue 27 items 1 and 11)."""
    attested = state(
        UnitState.ATTESTED,
        by=OTHER,
        version="v1",
        update_id="other-v1-g0-a0",
        source=V1_SRC,
        previous_version=None,
        previous_source=None,
    )
    p = run(spec(), [_at(pod("p1", st=attested), HERE)], {"p1": agent("v1")}, DONE)
    assert any(isinstance(a, Claim) and a.pod.name == "p1" for a in p.actions)
    assert p.classes["p1"] is PodClass.IN_FLIGHT
    # a record of another WeightUpdate's attempt is still that update's pod
    verified = dataclasses.replace(attested, state=UnitState.VERIFIED)
    p = run(spec(), [_at(pod("p1", st=verified), HERE)], {"p1": agent("v1")}, DONE)
    assert p.classes["p1"] is PodClass.FOREIGN
