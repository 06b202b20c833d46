"""When a rollout attempt halts: the rules of the planner's step ``plan/deadlines.py``.

Two concepts live here, so that no step of the planner has to special-case them:

**A finished rollout converges stragglers; it never judges the version again.** Once every
selected unit was verified (or failed within ``maxFailedReplicas``) the rollout has a
``completionTime`` and its verdict stands. A pod that joins later (scale-up, a replaced or
restarted pod) is brought to the version like any other, but neither its failure nor the time
it takes is a verdict on the rollout: the pod is reported (``Failed`` with its reason, kept out
of traffic; or a note such as ``Joining``) and the verified pods are left alone. Halting then
would roll the whole finished fleet back for one new pod (issue 27 items 1 and 7). Deployment
behaves alike: a scale-up of a complete Deployment is no new rollout and is never judged by
``progressDeadlineSeconds``.

One halt still applies, because it judges no version: failed units holding every slot while
units wait (**Tolerated failures** below) say that the rollout *cannot go on*, finished or not.
A finished rollout whose failed straggler held the only slot while a pod restarted onto other
weights waited for it sat ``Progressing`` for ever, the waiting pod listed with no reason
(found by the simulation tier). It halts (``FailureBudgetExceeded``, naming the fix) and waits
for a person, but its halt never rolls the finished fleet back (:func:`rolls_back`): only
``weightroll abort`` (``AbortedByUser``) does, as it asks to.

**The progress clock measures the current attempt.** ``progressDeadlineSeconds`` counts from
the attempt's last transition (a claim, a verdict), never from creation: time before the
operator's process started (``clock_floor``), before ``weightroll retry``, and on hold (paused,
canary hold, ``Blocked``) does not count. After completion nothing halts (above), but the clock
still runs for the ``WeightrollUpdateStuck`` alert: the first pass that finds work after
``Succeeded`` restarts it (``Persisted.idle``), as the end of a hold does, so
``lastProgressTime`` measures the convergence, not the hours since completion.

**A halt is written on the pods too.** The status persists a halt (``abortedAt``), but a
rollback it started is recorded on every pod it claims (``rollbackOf``), and that record
outlives the status field in two ways: an operator stopped after a rollback claim and before
its status write (a crash, the Lease fence), and a ``spec.version`` that leaves the version and
comes back (the persisted intents start afresh, ``Persisted.from_status``). The status then
said nothing of the halt while its pods were ``RolledBack``: no class of the planner waits for
them or works on them, so the rollout sat in ``Progressing`` or ``Pending`` for ever, or went
on claiming the rest of the fleet beside the rollback (found by the simulation tier). So a
rollback of the version on a pod *is* a halt of the version, reconstituted from the pods
(house rule 6) as a failed unit's is: the rollback goes on, and the version is tried again
only by ``weightroll retry``, as after a failure with ``onFailure: Halt``.

**Tolerated failures.** Up to ``maxFailedReplicas`` failed units are tolerated: they stay
drained and reported, and the rest of the fleet goes on. They are unavailable, so they use the
``maxUnavailable`` budget like any other unavailable unit (as a Deployment counts every
unavailable replica); when they hold all of it while units still wait for a slot, the rollout
cannot go on, and it halts at once (``FailureBudgetExceeded``, naming the fix) instead of
waiting for the progress deadline. The admission webhook refuses such a spec up front when
``maxUnavailable`` is a number (:func:`budget_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from weightroll_operator.api.v1alpha1 import OnFailure, StrategySpec
from weightroll_operator.domain.conditions import Reason

__all__ = [
    "Verdict",
    "budget_problem",
    "deadline_problem",
    "halt_verdict",
    "progress_clock",
    "rolls_back",
]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A new halt: the ``abortReason`` and the Event's message."""

    reason: str
    message: str


def progress_clock(
    last_progress: datetime | None,
    floors: tuple[datetime | None, ...],
    *,
    hold_released: bool,
    now: datetime,
) -> datetime | None:
    """When the current attempt last made progress, as far as the deadline may count.

    Args:
        last_progress: the persisted last transition (or the start); ``None``: not started.
        floors: times before which nothing counts (the operator's start, ``retriedAt``).
        hold_released: a hold ended this pass: the clock restarts now.
        now: this pass's time.

    Returns:
        The time the deadline counts from; ``None`` while the attempt has not started.
    """
    if hold_released:
        return now
    if last_progress is None:
        return None
    return max([last_progress, *(f for f in floors if f is not None)])


def halt_verdict(
    strategy: StrategySpec,
    *,
    finished: bool,
    rolled_back: list[str],
    canary_failed: list[str],
    failed_units: int,
    max_unavailable: int,
    drained_failed_units: int | None = None,
    waiting_for_slot: int,
    working: bool,
    progressed: bool,
    clock: datetime | None,
    now: datetime,
) -> Verdict | None:
    """Whether this pass halts the rollout, and why (``None``: it goes on).

    Args:
        strategy: the spec's strategy.
        finished: the rollout completed (``completionTime``): only a rollout that cannot go
            on halts (module doc).
        rolled_back: units a rollback from this version was recorded on (module doc).
        canary_failed: canary units that failed during the canary phase.
        failed_units: failed units, this pass's verdicts included.
        max_unavailable: the resolved ``maxUnavailable``.
        drained_failed_units: the failed units that hold a slot (out of traffic); ``None``:
            every failed unit (a failed prefetch leaves its unit serving: it holds none).
        waiting_for_slot: units still to start that are in traffic (each needs a slot).
        working: units are in flight or still to start, and the rollout is not on hold.
        progressed: this pass made a transition.
        clock: :func:`progress_clock`.
        now: this pass's time.
    """
    if not finished:
        verdict = _judged(strategy, rolled_back, canary_failed, failed_units)
        if verdict is not None:
            return verdict
    holding = failed_units if drained_failed_units is None else drained_failed_units
    if holding and holding >= max_unavailable and waiting_for_slot:
        if finished:
            which, fix = "failed since the rollout finished", "raise spec.strategy.maxUnavailable"
        else:
            which = f"tolerated by maxFailedReplicas {strategy.max_failed_replicas}"
            fix = "raise spec.strategy.maxUnavailable above maxFailedReplicas"
        return Verdict(
            Reason.FAILURE_BUDGET_EXCEEDED,
            f"Halted: {holding} failed units ({which}) hold every maxUnavailable slot "
            f"({max_unavailable}) while {waiting_for_slot} units wait: {fix}, or "
            "`weightroll retry`",
        )
    deadline = timedelta(seconds=strategy.progress_deadline_seconds)
    if finished or not working or progressed or clock is None or now - clock <= deadline:
        return None
    return Verdict(
        Reason.PROGRESS_DEADLINE_EXCEEDED,
        f"Halted: no progress for {strategy.progress_deadline_seconds}s",
    )


def _judged(
    strategy: StrategySpec, rolled_back: list[str], canary_failed: list[str], failed_units: int
) -> Verdict | None:
    """The halts that judge the version: a rollback recorded, a failed canary, more failed
    units than tolerated (never after the rollout finished: module doc)."""
    if rolled_back:
        return Verdict(
            Reason.ROLLBACK_RECORDED,
            f"Halted: {', '.join(rolled_back)} rolled back from this version, a halt the "
            "status lost; `weightroll retry` tries the version again",
        )
    if canary_failed:
        return Verdict(
            Reason.CANARY_FAILED, f"Halted: canary unit {', '.join(canary_failed)} failed"
        )
    tolerated = strategy.max_failed_replicas
    if failed_units > tolerated:
        return Verdict(
            Reason.FAILURE_BUDGET_EXCEEDED,
            f"Halted: {failed_units} failed units exceed maxFailedReplicas {tolerated}",
        )
    return None


def rolls_back(strategy: StrategySpec, *, finished: bool, abort_reason: str | None) -> bool:
    """A halt rolls the touched pods back: under ``onFailure: Rollback``, unless the rollout
    had finished and the halt is its own (a finished fleet is rolled back only when a person
    asks, ``AbortedByUser``: module doc)."""
    if strategy.on_failure is not OnFailure.ROLLBACK:
        return False
    return not finished or abort_reason == Reason.ABORTED_BY_USER


def deadline_problem(strategy: StrategySpec) -> str | None:
    """A progress deadline that fails a unit before its own timeout can, or ``None``.

    The deadline counts from the claim, the unit's timer from the agent's acceptance, after
    the drain: with a deadline at or below ``updateTimeoutSeconds`` one slow but healthy unit
    halts the whole rollout.
    """
    deadline, timeout = strategy.progress_deadline_seconds, strategy.update_timeout_seconds
    if deadline > timeout:
        return None
    return (
        f"spec.strategy.progressDeadlineSeconds ({deadline}) must be greater than "
        f"spec.strategy.updateTimeoutSeconds ({timeout}): one unit may take that long without "
        f"a transition; set progressDeadlineSeconds above {timeout} (default 1800)"
    )


def budget_problem(strategy: StrategySpec) -> str | None:
    """``maxFailedReplicas`` tolerated failures that would hold every ``maxUnavailable`` slot.

    Only a numeric ``maxUnavailable`` is judged: a percentage resolves against the fleet's
    size, which admission does not know (the running rollout halts instead, module doc).
    """
    budget = strategy.max_unavailable
    if not isinstance(budget, int) or strategy.max_failed_replicas < budget:
        return None
    return (
        f"spec.strategy.maxFailedReplicas ({strategy.max_failed_replicas}) must be less than "
        f"spec.strategy.maxUnavailable ({budget}): tolerated failed units stay drained and "
        "use the maxUnavailable budget, so that many would stop the rollout; lower "
        f"maxFailedReplicas to at most {budget - 1} or raise maxUnavailable"
    )
