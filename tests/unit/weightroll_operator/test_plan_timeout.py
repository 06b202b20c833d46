"""A unit's timeout asks the agent to abort, the verdict is the agent's (issue 27 item 4); a unit
is restored only at the spec's version (item 8). ``domain/unit_timeout.py``,
``domain/plan/advance.py`` ``outdated``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from weightroll_operator.domain.actions import AbortUpdate, Claim, GateOn, Settle
from weightroll_operator.domain.model import AgentView, PodView, UnitState, UpdateView
from weightroll_operator.domain.plan import Persisted

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import agent, pod, run, spec, state, summary

#: Claimed a while ago; the agent accepted the update 90 s before NOW: past a 60 s timeout by
#: less than the abort's grace.
CLAIMED = state(started="2026-01-01T11:58:00Z")
ACCEPTED = "2026-01-01T11:58:30Z"
S = spec(updateTimeoutSeconds=60, onFailure="Rollback")
STARTED = Persisted(target_version="v2", start_time="2026-01-01T11:58:00Z")


def _with_update(phase: UpdatePhase, started: str = ACCEPTED, **kw: Any) -> AgentView:
    view = agent(phase=phase, **kw)
    assert view.update is not None
    update = UpdateView(
        id=view.update.id,
        phase=phase,
        version="v2",
        committed=view.update.committed,
        reasons=view.update.reasons,
        started_at=started,
    )
    return replace(view, update=update)


def _pods() -> list[PodView]:
    return [pod("p0", gate=False, ready=False, st=CLAIMED), pod("p1", st=state(UnitState.VERIFIED))]


def test_a_timed_out_update_is_aborted_and_not_failed_before_the_agent_says_so() -> None:
    """The abort may lose the race to a commit: failing the unit in the same pass failed a unit
    that succeeded, and persisted the halt (with Rollback: rolled the fleet back)."""
    p = run(S, _pods(), {"p0": _with_update(UpdatePhase.LOADING)}, STARTED)
    assert summary(p) == [("AbortUpdate", "p0")]
    assert p.persisted.aborted_at is None and not p.rolling_back
    assert p.in_flight_units == 1 and "p0" not in p.reasons


def test_the_commit_that_won_the_race_is_verified() -> None:
    p = run(S, _pods(), {"p0": _with_update(UpdatePhase.COMMITTED)}, STARTED)
    assert p.persisted.aborted_at is None and not p.rolling_back
    steps = [s for s in summary(p) if s[0] != "Emit"]
    assert steps == [("GateOn", "p0"), ("Settle", "p0")]
    settled = [a for a in p.actions if isinstance(a, Settle)]
    assert settled[0].state.state is UnitState.VERIFIED


def test_the_abort_that_won_fails_the_unit_with_the_timeout_reason() -> None:
    p = run(S, _pods(), {"p0": _with_update(UpdatePhase.ABORTED)}, STARTED)
    assert "UpdateTimeout" in p.reasons["p0"]
    assert [a.state.state for a in p.actions if isinstance(a, Settle)] == [UnitState.FAILED]
    assert not any(isinstance(a, AbortUpdate) for a in p.actions)


def test_committed_but_not_ready_at_the_timeout_fails_without_an_abort() -> None:
    """Nothing to abort: the abort got a 409 on every pass, the Settle behind it was skipped,
    and the unit stayed in flight for ever."""
    committed = _with_update(UpdatePhase.COMMITTED, ready=False)
    p = run(S, _pods(), {"p0": committed}, STARTED)
    assert not any(isinstance(a, (AbortUpdate, GateOn)) for a in p.actions)
    assert [a.state.state for a in p.actions if isinstance(a, Settle)] == [UnitState.FAILED]
    assert p.reasons["p0"].startswith("NotReadyAfterCommit")


def test_an_abort_not_confirmed_within_its_grace_fails_the_unit() -> None:
    long_ago = "2026-01-01T11:00:00Z"
    p = run(S, _pods(), {"p0": _with_update(UpdatePhase.LOADING, started=long_ago)}, STARTED)
    steps = [s for s in summary(p) if s[0] in ("AbortUpdate", "Settle")]
    assert steps == [("Settle", "p0"), ("AbortUpdate", "p0")]  # the verdict first
    assert "not confirmed" in p.reasons["p0"]


def test_a_commit_of_a_version_the_spec_reverted_is_never_restored() -> None:
    """Issue 27 item 8: spec.version reverted v2 -> v1 while a pod loaded v2; its commit put the
    pod back into traffic at v2. The unit's target is the spec's until it is back in traffic:
    it is retargeted at v1, still drained."""
    reverted = spec(_spec={"version": "v1", "source": {"uri": "/weights/v1"}})
    loading_v2 = pod("p0", gate=False, ready=False, st=state(started="2026-01-01T11:59:00Z"))
    p = run(
        reverted,
        [loading_v2],
        {"p0": agent(phase=UpdatePhase.COMMITTED)},
        Persisted(target_version="v1"),
    )
    assert not any(isinstance(a, GateOn) for a in p.actions)
    claims = [a for a in p.actions if isinstance(a, Claim)]
    assert [(a.pod.name, a.state.version, a.state.state) for a in claims] == [
        ("p0", "v1", UnitState.DRAINING)
    ]
    assert claims[0].state.previous_version == "v1"
    assert not any(isinstance(a, Settle) and a.state.state is UnitState.VERIFIED for a in p.actions)


#: spec.version reverted v2 -> v1 (a new generation: the persisted halt fields start over).
REVERTED = spec(updateTimeoutSeconds=60, _spec={"version": "v1", "source": {"uri": "/weights/v1"}})


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        # drained, never sent (the claim's timer ran out meanwhile): the Claim retargeting it
        # and a Settle failing the superseded attempt were planned together, the Settle won,
        # and the v1 rollout halted (FailureBudgetExceeded) for it (found by the sim tier)
        (agent("v1"), "never accepted"),
        # the agent's verdict on the superseded attempt: failed, or aborted at the timeout
        (_with_update(UpdatePhase.FAILED, version="v1"), "failed"),
        (_with_update(UpdatePhase.ABORTED, version="v1"), "aborted"),
        # an agent that does not answer may still run it: the retarget waits for an answer
        # (recorded at once, the new attempt named one the agent never got while it ran the
        # old one; found by the sim tier), the unit still in flight and no failure either
        (agent(reachable=False), "unreachable"),
    ],
)
def test_a_failure_of_an_attempt_at_a_version_the_spec_left_is_no_failure_of_the_spec(
    answer: AgentView, why: str
) -> None:
    """The attempt was at v2, the spec names v1 now: its failure is no verdict on this spec,
    so no failed unit and no halt; the unit is retargeted at v1 (still drained) on a timer of
    its own."""
    p = run(REVERTED, [pod("p0", gate=False, ready=False, st=CLAIMED)], {"p0": answer},
            Persisted(target_version="v1"))  # fmt: skip
    assert not any(isinstance(a, Settle) for a in p.actions), why
    assert p.persisted.aborted_at is None and "p0" not in p.reasons
    if why == "unreachable":
        assert not any(isinstance(a, Claim) for a in p.actions)
        assert p.in_flight_units == 1
        return
    [claim] = [a for a in p.actions if isinstance(a, Claim)]
    assert (claim.state.version, claim.state.state, claim.state.attempt) == (
        "v1", UnitState.DRAINING, CLAIMED.attempt + 1
    )  # fmt: skip
    assert claim.state.started_at == "2026-01-01T12:00:00Z"  # the new attempt's timer: now
    assert p.in_flight_units == 1


def test_a_failure_at_the_spec_version_still_fails_the_unit() -> None:
    """The same answers for an attempt at the spec's version are its verdict, as before."""
    p = run(S, [pod("p0", gate=False, ready=False, st=CLAIMED)], {"p0": agent("v1")}, STARTED)
    assert [a.state.state for a in p.actions if isinstance(a, Settle)] == [UnitState.FAILED]
    assert not any(isinstance(a, Claim) for a in p.actions)
