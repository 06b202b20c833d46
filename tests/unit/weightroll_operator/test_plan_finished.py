"""A finished rollout converges stragglers, the progress clock measures the current attempt, and
``maxFailedReplicas`` is tolerance (issue 27 items 1, 7 and 9; ``domain/halts.py``).

Table tests of the planner with the status computed from the plan, as a pass would write it.
"""

from __future__ import annotations

import pytest
from weightroll_operator.api.v1alpha1 import ConditionType, Phase, WeightUpdateStatus
from weightroll_operator.domain.actions import Claim, GateOn, Settle
from weightroll_operator.domain.conditions import Reason, get_condition, timestamp
from weightroll_operator.domain.model import PodView, UnitState
from weightroll_operator.domain.plan import Persisted
from weightroll_operator.domain.status import build_status

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import NOW, agent, pod, run, spec, state

#: Succeeded two hours before NOW: longer ago than the default progressDeadlineSeconds (1800).
LONG_AGO = "2026-01-01T10:00:00Z"
FINISHED = Persisted(
    target_version="v2",
    start_time="2026-01-01T09:50:00Z",
    completion_time=LONG_AGO,
    last_progress_time=LONG_AGO,
)
VERIFIED = state(UnitState.VERIFIED, started="2026-01-01T09:55:00Z")
#: A pod whose vLLM is still booting: its agent answers, no version yet (not claimable).
BOOTING = agent("")


def _fleet_of_two_verified() -> list[PodView]:
    return [pod("p0", st=VERIFIED), pod("p1", st=VERIFIED)]


@pytest.mark.parametrize("on_failure", ["Halt", "Rollback"])
@pytest.mark.parametrize("straggler", ["added", "restarted"])
def test_a_finished_rollout_converges_a_straggler_long_after_it_succeeded(
    on_failure: str, straggler: str
) -> None:
    """Item 1: default settings, Succeeded 2 h ago; a new (or restarted) pod whose engine still
    boots halted the rollout with ProgressDeadlineExceeded (and, with Rollback, rolled the
    whole fleet back). It must wait for the pod, then converge it."""
    s = spec(onFailure=on_failure)
    if straggler == "added":
        pods = [*_fleet_of_two_verified(), pod("p2", ready=False, gate=None)]
        late = "p2"
    else:  # vLLM restarted under a verified pod: not ready, its agent booting
        pods = [pod("p0", st=VERIFIED), pod("p1", st=VERIFIED, ready=False)]
        late = "p1"
    first = run(s, pods, {late: BOOTING}, FINISHED)
    assert first.persisted.aborted_at is None, first.persisted.abort_reason
    assert not first.rolling_back
    assert not any(isinstance(a, Claim) for a in first.actions)
    # once its engine answers, the straggler is claimed and updated like any other pod
    second = run(s, pods, {late: agent("v1")}, first.persisted)
    assert [a.pod.name for a in second.actions if isinstance(a, Claim)] == [late]
    assert second.persisted.aborted_at is None
    assert second.persisted.completion_time == LONG_AGO


@pytest.mark.parametrize("on_failure", ["Halt", "Rollback"])
def test_a_failing_scale_up_pod_after_success_is_reported_not_rolled_back(
    on_failure: str,
) -> None:
    """Item 7: one scale-up pod failing its update after Succeeded rolled the finished fleet
    back under Rollback (and halted it under Halt). It is reported Failed, kept out of traffic,
    with its reason; the verified pods are left alone."""
    s = spec(onFailure=on_failure)
    late = state(started="2026-01-01T11:59:00Z")
    pods = [*_fleet_of_two_verified(), pod("p2", ready=False, gate=False, st=late)]
    failing = {"p2": agent(phase=UpdatePhase.FAILED, reasons=["digest mismatch"])}
    p = run(s, pods, failing, FINISHED)
    assert p.persisted.aborted_at is None, p.persisted.abort_reason
    assert not p.rolling_back
    settled = [a for a in p.actions if isinstance(a, Settle)]
    assert [(a.pod.name, a.state.state) for a in settled] == [("p2", UnitState.FAILED)]
    assert not any(isinstance(a, (Claim, GateOn)) for a in p.actions)
    assert "digest mismatch" in p.reasons["p2"]
    status = build_status(p, s, None, 1, NOW)
    assert status.phase is Phase.SUCCEEDED
    degraded = get_condition(status.conditions, ConditionType.DEGRADED)
    assert degraded is not None and degraded.status == "True" and "p2" in degraded.message
    assert {r.name: r.state for r in status.pods}["p2"] == "Failed"
    # and the next pass, with the failure recorded on the pod, changes nothing
    failed = state(UnitState.FAILED, reason=p.reasons["p2"])
    pods[2] = pod("p2", ready=False, gate=False, st=failed)
    again = run(s, pods, {"p2": agent("v1", ready=False)}, p.persisted)
    assert again.persisted.aborted_at is None and not again.rolling_back
    assert not any(isinstance(a, (Claim, Settle)) for a in again.actions)


def test_the_deadline_still_counts_an_unfinished_attempt() -> None:
    """The clock is the attempt's: before completion a stuck rollout still halts."""
    unfinished = Persisted(target_version="v2", start_time=LONG_AGO, last_progress_time=LONG_AGO)
    pods = [pod("p0", st=VERIFIED), pod("p1", ready=False, gate=None)]
    p = run(spec(), pods, {"p1": BOOTING}, unfinished)
    assert p.persisted.abort_reason == Reason.PROGRESS_DEADLINE_EXCEEDED


def _failed(name: str) -> PodView:
    return pod(name, ready=False, gate=False, st=state(UnitState.FAILED, reason="UpdateFailed: x"))


def test_tolerated_failures_let_the_rollout_finish_degraded() -> None:
    """Item 9 (below maxUnavailable): one failed unit tolerated by maxFailedReplicas 1 left the
    rollout Progressing for ever with nothing to do. It completes: Succeeded, Degraded naming
    the failed pod."""
    s = spec(maxUnavailable=2, maxFailedReplicas=1)
    started = Persisted(target_version="v2", start_time="2026-01-01T11:50:00Z")
    pods = [_failed("p0"), pod("p1", st=VERIFIED), pod("p2", st=VERIFIED)]
    p = run(s, pods, {"p0": agent("v1", ready=False)}, started)
    assert p.persisted.aborted_at is None
    assert p.completed
    status = build_status(p, s, None, 1, NOW)
    assert status.phase is Phase.SUCCEEDED
    assert status.replicas.failed == 1 and status.replicas.verified == 2
    degraded = get_condition(status.conditions, ConditionType.DEGRADED)
    assert degraded is not None and degraded.status == "True" and "p0" in degraded.message


def test_a_fleet_of_failures_alone_is_no_completion() -> None:
    s = spec(maxUnavailable="100%", maxFailedReplicas=1)
    p = run(s, [_failed("p0")], {"p0": agent("v1", ready=False)})
    assert not p.completed


def test_tolerated_failures_holding_every_slot_halt_at_once() -> None:
    """Item 9 (at maxUnavailable): the tolerated failed unit held the only slot, nothing could
    start, and only the progress deadline (30 min later) ended it. It halts at once, and the
    message names the fix."""
    s = spec(maxUnavailable=1, maxFailedReplicas=1)
    started = Persisted(
        target_version="v2", start_time="2026-01-01T11:50:00Z", last_progress_time=NOW.isoformat()
    )
    pods = [_failed("p0"), pod("p1", st=VERIFIED), pod("p2")]
    p = run(s, pods, {"p0": agent("v1", ready=False), "p2": agent("v1")}, started)
    assert p.persisted.abort_reason == Reason.FAILURE_BUDGET_EXCEEDED
    emits = [a for a in p.actions if getattr(a, "reason", None) == Reason.FAILURE_BUDGET_EXCEEDED]
    assert emits and "maxUnavailable" in emits[0].message  # type: ignore[attr-defined]
    assert not any(isinstance(a, Claim) for a in p.actions)


def test_tolerated_failures_with_room_left_go_on() -> None:
    s = spec(maxUnavailable=2, maxFailedReplicas=1)
    pods = [_failed("p0"), pod("p1", st=VERIFIED), pod("p2")]
    p = run(s, pods, {"p0": agent("v1", ready=False), "p2": agent("v1")})
    assert p.persisted.aborted_at is None
    assert [a.pod.name for a in p.actions if isinstance(a, Claim)] == ["p2"]


def test_a_straggler_starts_the_progress_clock_of_the_convergence() -> None:
    """The first pass that finds work after Succeeded restarts the progress clock (as the end
    of a hold does): ``lastProgressTime`` (and with it the WeightrollUpdateStuck alert) measures the
    convergence, not the hours since completion."""
    status = WeightUpdateStatus(
        phase=Phase.SUCCEEDED,
        target_version="v2",
        start_time=FINISHED.start_time,
        completion_time=FINISHED.completion_time,
        last_progress_time=FINISHED.last_progress_time,
    )
    persisted = Persisted.from_status(status, "v2")
    pods = [*_fleet_of_two_verified(), pod("p2", ready=False, gate=None)]
    p = run(spec(), pods, {"p2": BOOTING}, persisted)
    assert p.persisted.last_progress_time == timestamp(NOW)
    idle = run(spec(), _fleet_of_two_verified(), {}, persisted)
    assert idle.persisted.last_progress_time == LONG_AGO  # nothing to do: nothing written


@pytest.mark.parametrize("on_failure", ["Halt", "Rollback"])
def test_a_finished_rollout_whose_failed_straggler_holds_every_slot_halts_in_place(
    on_failure: str,
) -> None:
    """Found by the simulation tier: after Succeeded, a straggler failed (drained, holding the
    only slot) and a verified pod restarted onto other weights waits, in traffic, for a slot
    that never comes. The rollout stayed Progressing for ever, the waiting pod listed with no
    reason. It cannot go on: it halts, naming the fix, and never rolls the finished fleet back
    (``domain.halts``)."""
    s = spec(maxUnavailable=1, onFailure=on_failure)
    pods = [pod("p0", st=VERIFIED), _failed("p1"), pod("p2", st=VERIFIED)]
    answers = {"p0": agent("v2"), "p1": agent("v1", ready=False), "p2": agent("v1")}
    p = run(s, pods, answers, FINISHED)
    assert p.persisted.abort_reason == Reason.FAILURE_BUDGET_EXCEEDED
    emits = [a for a in p.actions if getattr(a, "reason", None) == Reason.FAILURE_BUDGET_EXCEEDED]
    assert emits and "finished" in emits[0].message  # type: ignore[attr-defined]
    assert not p.rolling_back
    assert not any(isinstance(a, Claim) for a in p.actions)
    status = build_status(p, s, None, 1, NOW)
    assert status.phase is Phase.FAILED and status.abort_reason == Reason.FAILURE_BUDGET_EXCEEDED
    # with room for the waiting pod the finished rollout goes on converging it
    room = run(spec(maxUnavailable=2, onFailure=on_failure), pods, answers, FINISHED)
    assert room.persisted.aborted_at is None
    assert [a.pod.name for a in room.actions if isinstance(a, Claim)] == ["p2"]


def test_a_person_aborting_a_finished_rollout_rolls_it_back() -> None:
    """Only the rollout's own halts spare a finished fleet: ``weightroll abort`` under
    ``onFailure: Rollback`` rolls back as it says (docs/api.md, "Steering a rollout")."""
    s = spec(onFailure="Rollback")
    aborted = Persisted(
        target_version="v2",
        start_time=FINISHED.start_time,
        completion_time=FINISHED.completion_time,
        aborted_at=timestamp(NOW),
        abort_reason=Reason.ABORTED_BY_USER,
    )
    p = run(s, _fleet_of_two_verified(), {"p0": agent("v2"), "p1": agent("v2")}, aborted)
    assert p.rolling_back
