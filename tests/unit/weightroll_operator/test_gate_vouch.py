"""What our gate vouches for, and whether it still does (``domain.gate_vouch``), table-tested;
and the planner judging it under a record that is no verdict (a prefetch claim)."""

from __future__ import annotations

import dataclasses

import pytest
from weightroll_operator.domain.actions import Claim, GateOff, GateOn
from weightroll_operator.domain.gate_vouch import GateVouch, breach
from weightroll_operator.domain.model import UnitState, WeightState
from weightroll_operator.domain.standing import vouch_of

from tests.unit.weightroll_operator.builders import ME, agent, pod, run, spec, state

V2_ON_X = GateVouch("v2", "wu-v2-a1", "uid|ip|0")


@pytest.mark.parametrize(
    ("incarnation", "reachable", "ready", "version", "committed", "expected"),
    [
        # the vouched containers serve the vouched commit: it stands
        ("uid|ip|0", True, True, "v2", "wu-v2-a1", None),
        # other containers whose agent confirms the same weights: it stands (re-recorded)
        ("uid|ip|1", True, True, "v2", "wu-v2-a1", None),
        # booted at the vouched version (no commit names it): the same weights
        ("uid|ip|1", True, True, "v2", None, None),
        # restarted onto the boot weights: attested again for them
        ("uid|ip|1", True, True, "v1", None, ("its agent serves v1, not v2", "v1")),
        # another commit of the same label (a trainer push): attested again for it
        ("uid|ip|0", True, True, "v2", "push-7", ("committed by push-7", "v2")),
        # an agent not ready holds the pod out itself (its /readyz): nothing to do
        ("uid|ip|1", True, False, "v1", None, None),
        # silent, on the vouched containers: their probe guards them
        ("uid|ip|0", False, False, None, None, None),
        # silent, on other containers: fail closed, the gate goes off
        ("uid|ip|1", False, False, None, None, ("does not answer", None)),
    ],
)
def test_breach(
    incarnation: str,
    reachable: bool,
    ready: bool,
    version: str | None,
    committed: str | None,
    expected: tuple[str, str | None] | None,
) -> None:
    found = breach(
        V2_ON_X,
        incarnation,
        reachable=reachable,
        ready=ready,
        version=version,
        committed_update_id=committed,
    )
    if expected is None:
        assert found is None
        return
    assert found is not None
    words, attest = expected
    assert words in found.why
    assert (found.now.version if found.now else None) == attest
    if found.now is not None:
        assert found.now == GateVouch(attest, committed, incarnation)


def test_a_vouch_names_no_containers_on_a_record_older_than_the_incarnation() -> None:
    old = GateVouch("v2", "wu-v2")
    silent = breach(
        old, "uid|ip|9", reachable=False, ready=False, version=None, committed_update_id=None
    )
    assert silent is None


@pytest.mark.parametrize(
    ("st", "expected"),
    [
        # records older than the field: derived from what their own GateOn vouched for
        (
            state(UnitState.VERIFIED, incarnation="uid|ip|0"),
            GateVouch("v2", "wu-v2", "uid|ip|0"),
        ),
        (state(UnitState.ROLLED_BACK, version="v1"), GateVouch("v1", "wu-v1")),
        (state(UnitState.PREFETCHING), GateVouch("v1")),
        (state(UnitState.DRAINING), None),
        (state(UnitState.WITHDRAWN), None),
        # the field, whatever the state
        (state(UnitState.WITHDRAWN, gate=V2_ON_X), V2_ON_X),
        (state(UnitState.PREFETCHING, gate=V2_ON_X), V2_ON_X),
    ],
)
def test_vouch_of(st: WeightState, expected: GateVouch | None) -> None:
    assert vouch_of(st) == expected


def test_the_vouch_survives_the_annotation_and_older_records_read_as_they_are() -> None:
    st = state(UnitState.PREFETCHING, gate=V2_ON_X)
    assert WeightState.from_json(st.to_json()) == st
    assert '"gate": {"incarnation": "uid|ip|0", "updateId": "wu-v2-a1", "version": "v2"}' in (
        st.to_json()
    )
    older = state(UnitState.VERIFIED)
    assert '"gate"' not in older.to_json()
    assert WeightState.from_json(older.to_json()) == older


def test_a_gate_under_a_prefetch_claim_is_judged_in_the_pass_that_claims() -> None:
    """The defect (``make soak`` seed 4242): a verified pod restarted onto its boot weights v1
    is claimed to prefetch v2 again; the claim rewrote the record and nothing judged the gate
    set for v2. Now the claim keeps the vouch and the same pass attests the gate for v1."""
    verified = state(UnitState.VERIFIED, incarnation="uid|ip|0")
    p0 = dataclasses.replace(pod("p0", st=verified), incarnation="uid|ip|1")
    p = run(spec(maxUnavailable=1, prefetch={"mode": "Host"}), [p0], {"p0": agent("v1")})
    acts = [(type(a).__name__, a) for a in p.actions if isinstance(a, Claim | GateOn | GateOff)]
    assert [name for name, _ in acts] == ["Claim", "GateOn", "Claim"], p.actions
    first, gate_on, second = (a for _, a in acts)
    assert isinstance(first, Claim) and first.state.state is UnitState.PREFETCHING
    assert first.state.gate == GateVouch("v2", "wu-v2", "uid|ip|0")  # kept from the verdict
    assert isinstance(gate_on, GateOn) and gate_on.version == "v1"
    assert isinstance(second, Claim) and second.owner == ME
    assert second.state == first.state.evolve(gate=GateVouch("v1", None, "uid|ip|1"))
