"""A verdict vouches for the files it loaded, not for every source labelled the same version.

Before: pods were counted updated whenever their agent (or their record) named ``spec.version``.
``spec.source`` may not change while the version stays (admission), but it may change together
with the version and back (v2 from S1, v3 from S2, v2 from S2), and a second WeightUpdate may
name the same version with other files: the fleet went Succeeded serving S1 and S2 as "v2".
"""

from __future__ import annotations

import pytest
from weightroll_operator.domain.actions import Claim, GateOn
from weightroll_operator.domain.model import SourceRef, UnitState, WeightState
from weightroll_operator.domain.plan import PodClass

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import (
    ME,
    OTHER,
    V1_SRC,
    V2_SRC,
    agent,
    pod,
    run,
    spec,
    state,
)

S1 = SourceRef(uri="/weights/v2-first-try")


def claims(p: object) -> dict[str, WeightState]:
    return {a.pod.name: a.state for a in p.actions if isinstance(a, Claim)}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("served_from", "updated"),
    [
        (V2_SRC, True),
        (SourceRef(uri="file:///weights/v2"), True),  # the same files, spelled as a URI
        (SourceRef(uri="/weights//v2/"), True),
        (S1, False),  # other files under the same label
        (SourceRef(uri="/weights/v2", manifest="/weights/v2/manifest.json"), False),
        (None, False),  # unknown: a trainer push, or boot weights the agent has no record of
    ],
)
def test_a_pod_counts_as_updated_only_serving_spec_source(
    served_from: SourceRef | None, updated: bool
) -> None:
    p = run(spec(), [pod("p0")], {"p0": agent("v2", source=served_from)})
    assert (p.classes["p0"] is PodClass.UPDATED) is updated, p.classes
    assert bool(claims(p)) is not updated


def test_our_verdict_from_other_files_is_no_verdict_for_this_spec() -> None:
    """v2 from S1 verified, then spec v3/S2, then v2/S2: the pod is asked and updated again,
    and the note says why."""
    verified_s1 = state(UnitState.VERIFIED, source=S1)
    p = run(spec(), [pod("p0", st=verified_s1)], {"p0": agent("v2", source=S1)})
    claimed = claims(p)
    assert list(claimed) == ["p0"]
    assert claimed["p0"].source == V2_SRC and claimed["p0"].version == "v2"
    assert "not from spec.source /weights/v2" in p.notes["p0"], p.notes


def test_an_unreachable_pod_verified_from_other_files_is_unknown() -> None:
    verified = state(UnitState.VERIFIED, source=S1)
    p = run(spec(), [pod("p0", st=verified)], {"p0": agent(reachable=False)})
    assert p.classes["p0"] is PodClass.UNKNOWN
    assert not p.completed


def test_our_verdict_from_spec_source_stands_while_the_agent_is_unreachable() -> None:
    verified = state(UnitState.VERIFIED)
    p = run(spec(), [pod("p0", st=verified)], {"p0": agent(reachable=False)})
    assert p.classes["p0"] is PodClass.UPDATED


def test_another_weightupdates_verdict_at_the_version_from_other_files_is_updated_again() -> None:
    theirs = state(UnitState.VERIFIED, by=OTHER, source=S1)
    p = run(spec(), [pod("p0", st=theirs)], {"p0": agent("v2", source=S1)})
    assert list(claims(p)) == ["p0"]


def test_a_claim_records_spec_source_and_a_drain_not_yet_sent_is_retargeted() -> None:
    """A pod claimed for v2 from S1 whose update was not sent yet when the spec went back to
    v2 from S2: the record is rewritten for S2, so its verdict names the files it loaded."""
    fresh = run(spec(), [pod("p0")], {"p0": agent("v1")})
    assert claims(fresh)["p0"].source == V2_SRC
    assert claims(fresh)["p0"].previous_source == V1_SRC
    draining_s1 = state(UnitState.DRAINING, source=S1, attempt=1)
    p = run(spec(), [pod("p0", gate=False, ready=False, st=draining_s1)], {"p0": agent("v1")})
    retarget = claims(p)["p0"]
    assert retarget.source == V2_SRC and retarget.attempt == 2, retarget


def test_a_rollback_records_the_source_it_rolls_back_to() -> None:
    failed = state(UnitState.FAILED, reason="DigestMismatch", attempt=1)
    verified = state(UnitState.VERIFIED)
    pods = [pod("p0", st=verified), pod("p1", gate=False, ready=False, st=failed, owner=ME)]
    s = spec(maxUnavailable=2, onFailure="Rollback")
    agents = {"p0": agent("v2"), "p1": agent("v1", phase=UpdatePhase.FAILED)}
    p = run(s, pods, agents)
    rolled = [st for st in claims(p).values() if st.state is UnitState.ROLLING_BACK]
    assert rolled and all(st.source == V1_SRC and st.version == "v1" for st in rolled), rolled


def test_the_source_survives_the_annotation() -> None:
    st = state(UnitState.VERIFIED, source=SourceRef(uri="/w/v2", manifest="/w/v2/m.json"))
    assert WeightState.from_json(st.to_json()) == st
    older = st.evolve(source=None)  # written before the field existed
    assert "source" not in older.to_json().replace("previousSource", "")
    assert WeightState.from_json(older.to_json()) == older


def test_the_canary_goes_first_again_for_other_files_under_the_same_label() -> None:
    """Review of the fix: units verified at v2 from S1 counted as touched for v2 from S2, so
    the canary phase was over and every unit went to the untested files at once."""
    verified_s1 = state(UnitState.VERIFIED, source=S1)
    pods = [pod(f"p{i}", st=verified_s1) for i in range(4)]
    agents = {f"p{i}": agent("v2", source=S1) for i in range(4)}
    p = run(spec(maxUnavailable=4, canary=1), pods, agents)
    assert list(claims(p)) == ["p0"], claims(p)


def test_a_record_older_than_the_source_field_stands_while_its_agent_cannot_be_asked() -> None:
    """Review of the fix: an agent that missed one answer after the operator upgrade made a
    Succeeded fleet's pod wanted again (and, past the deadline, halted or rolled back)."""
    legacy = state(UnitState.VERIFIED, source=None)
    p = run(spec(), [pod("p0", st=legacy)], {"p0": agent(reachable=False)})
    assert p.classes["p0"] is PodClass.UPDATED
    # ... and is judged by its agent whenever it answers (asked every pass)
    p = run(spec(), [pod("p0", st=legacy)], {"p0": agent("v2", source=S1)})
    assert list(claims(p)) == ["p0"]


def test_a_unit_in_flight_for_other_files_holds_its_canary_slot() -> None:
    """Second review: a unit still draining for v2 from S1 was not counted as touched, so a
    second unit started beside the canary, and two touched units then ended the phase."""
    draining_s1 = state(UnitState.DRAINING, source=S1, attempt=1)
    pods = [pod("p0", gate=False, st=draining_s1), *(pod(f"p{i}") for i in range(1, 4))]
    agents = {"p0": agent("v1"), **{f"p{i}": agent("v1") for i in range(1, 4)}}
    p = run(spec(maxUnavailable=3, canary=1), pods, agents)
    assert [name for name in claims(p) if name != "p0"] == [], claims(p)


def test_a_commit_of_other_files_is_not_counted_for_this_spec() -> None:
    """Second review: the agent had accepted the v2/S1 update before the spec went to v2/S2;
    its commit settled Verified and counted as updated, so the WeightUpdate completed."""
    loading_s1 = state(UnitState.DRAINING, source=S1, attempt=1)
    pods = [pod("p0", gate=False, ready=False, st=loading_s1)]
    committed = agent(phase=UpdatePhase.COMMITTED, source=S1)
    p = run(spec(), pods, {"p0": committed})
    # not restored at the other files either (issue 27 item 8): retargeted, still drained
    assert p.classes["p0"] is PodClass.IN_FLIGHT, p.classes
    assert not any(isinstance(a, GateOn) for a in p.actions)
    assert not p.completed and p.persisted.completion_time is None


def test_no_retarget_while_the_agent_runs_the_recorded_attempt() -> None:
    """Second review: an update the agent runs but did not report was retargeted, so a second
    update would have been sent beside it."""
    draining_s1 = state(UnitState.DRAINING, source=S1, attempt=1)
    busy = agent("v1", active_update_id=draining_s1.update_id)
    p = run(spec(), [pod("p0", gate=False, ready=False, st=draining_s1)], {"p0": busy})
    assert claims(p) == {}


@pytest.mark.parametrize("outcome", [UpdatePhase.COMMITTED, UpdatePhase.FAILED])
def test_a_unit_settling_for_other_files_is_not_this_specs_canary_verdict(
    outcome: UpdatePhase,
) -> None:
    """Third review: in the pass a unit in flight for v2/S1 settled, it still counted as the
    touched canary: a commit ended the canary (the rest started on no verdict for S2), a
    failure halted with CanaryFailed whatever maxFailedReplicas allowed."""
    draining_s1 = state(UnitState.DRAINING, source=S1, attempt=1)
    pods = [pod("p0", gate=False, ready=False, st=draining_s1)]
    pods += [pod(f"p{i}") for i in range(1, 5)]
    agents = {f"p{i}": agent("v1") for i in range(1, 5)}
    agents["p0"] = agent(phase=outcome, source=S1, reasons=["DigestMismatch: x"])
    s = spec(maxUnavailable=4, canary=1, maxFailedReplicas=1)
    p = run(s, pods, agents)
    assert p.persisted.aborted_at is None, p.persisted
    assert len([name for name in claims(p) if name != "p0"]) <= 1, claims(p)
