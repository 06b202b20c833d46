"""Step 3, :func:`deadlines`: holds, halts and what is left to start."""

from __future__ import annotations

from dataclasses import dataclass

from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.halts import halt_verdict, progress_clock
from weightroll_operator.domain.plan.classify import Seen, drained_failure, rollback_recorded
from weightroll_operator.domain.plan.context import (
    PREFETCH_FAILED,
    WANTING_CLASSES,
    PassContext,
    Persisted,
    PodClass,
    parse_time,
    target_source,
)

#: A unit is pending (still to start) when its pods are only in these classes and at least
#: one of them still wants the version (``WANTING_CLASSES``).
_STARTABLE = frozenset({PodClass.PENDING, PodClass.UPDATED, PodClass.UNKNOWN})


@dataclass(frozen=True, slots=True)
class Halt:
    """Step 3, :func:`deadlines`: holds, halts and what is left to start."""

    aborted_at: str | None
    abort_reason: str | None
    paused_reason: str | None
    #: A hold (pause, canary, Blocked) ended this pass, or a finished rollout found work
    #: again: the progress clock restarts now.
    hold_released: bool
    #: Units that still need this version and are not in flight.
    pending: tuple[Unit, ...]
    #: Units this WeightUpdate touched for this version (the canary is the first of them).
    touched: tuple[Unit, ...]
    #: The canary units have a verdict that stands (settled, not wanting the version again):
    #: units never touched may start beyond the canary (always True without a canary).
    canary_done: bool = True


def deadlines(ctx: PassContext, seen: Seen, persisted: Persisted, flying: frozenset[str]) -> Halt:
    """Step 3: the pause and canary holds, the failed canary, the failure budget and the
    progress deadline (a new halt is persisted as an abort intent and posted as an Event).

    Time on hold or Blocked, before the operator's start (``clock_floor``) or before a retry
    never counts against ``progressDeadlineSeconds``.
    """
    spec, now, owner, version = ctx.spec, ctx.now, ctx.fleet.owner, ctx.spec.version
    target = target_source(spec)
    units, by_unit = seen.units, seen.by_unit
    aborted_at, abort_reason = persisted.aborted_at, persisted.abort_reason

    finished = ctx.finished

    def failed(u: Unit) -> bool:
        return PodClass.FAILED in by_unit[u.key] or finished.get(u.key) == "failed"

    pending = tuple(
        u
        for u in units
        if u.key not in finished
        and u.key not in flying
        and by_unit[u.key] <= _STARTABLE
        and not by_unit[u.key].isdisjoint(WANTING_CLASSES)
    )
    touched_keys = {
        p.unit
        for p in ctx.fleet.pods
        if (st := p.state) is not None
        and st.attempted_by(owner)
        and st.version == version
        and st.rollback_of is None
        # touched for other files under this label is not touched for this spec (the canary
        # goes first again), unless still in flight after this pass: it holds a canary slot
        # until it settles (else one more unit started beside it, and the count then ended the
        # phase early), and its verdict, pass or fail, is never this spec's canary verdict; a
        # record older than the source field counts as it did
        and (st.source is None or p.unit in flying or target.same_files(st.source))
    }
    touched = tuple(u for u in units if u.key in touched_keys) if touched_keys else ()
    canary = spec.strategy.canary
    # The canary phase lasts while every unit touched for this version is a canary unit (no
    # start times involved: a re-claim rewrites them). The canary's verdict stands once each
    # of them is settled and does not want the version again: a retried failed canary, or a
    # verified one whose engine restarted before the rest started, earns it anew first. Once
    # units beyond it have started, the phase is over for good: a canary unit that fails later
    # is one failure among others, counted against maxFailedReplicas.
    canary_phase = canary is not None and len(touched) <= canary
    settled = all(
        u.key not in flying and by_unit[u.key].isdisjoint(WANTING_CLASSES) for u in touched
    )
    # With pauseAfterCanary only `weightroll promote` (the flag set false) ends the phase, so
    # units never touched start only within the canary's count, however many were touched.
    pause = canary is not None and spec.strategy.pause_after_canary
    canary_done = not pause and (
        not canary_phase or (canary is not None and len(touched) >= canary and settled)
    )
    canary_hold = (
        pause
        and canary is not None
        and len(touched) >= canary
        and settled
        and not flying
        and any(u.key not in touched_keys for u in pending)
    )
    paused_reason = (
        Reason.PAUSED_BY_SPEC if spec.paused else Reason.CANARY_COMPLETE if canary_hold else None
    )
    # A failed canary halts whatever maxFailedReplicas tolerates: the canary is the test.
    canary_failed = sorted(u.key for u in touched if failed(u)) if canary_phase else []
    hold_released = (persisted.held and paused_reason is None and not seen.blocked_by) or (
        persisted.idle and bool(flying or pending)
    )
    clock = progress_clock(
        parse_time(persisted.last_progress_time) or parse_time(persisted.start_time),
        (parse_time(persisted.clock_floor), parse_time(persisted.retried_at)),
        hold_released=hold_released,
        now=now,
    )
    retried_at = persisted.retried_at
    # Only a unit with a failed pod, or one that failed this pass, is counted below: most
    # passes have none, and then the counts need no walk over the units.
    failing_keys = seen.failing | {key for key, out in finished.items() if out == "failed"}
    failing = [u for u in units if u.key in failing_keys] if failing_keys else []
    rolled_back = sorted(
        {p.unit for p in ctx.fleet.pods if rollback_recorded(p.state, owner, version, retried_at)}
    )
    verdict = halt_verdict(
        spec.strategy,
        finished=persisted.completion_time is not None,
        rolled_back=rolled_back,
        canary_failed=canary_failed,
        failed_units=sum(1 for u in failing if failed(u)),
        drained_failed_units=sum(
            1
            for u in failing
            if drained_failure(seen, u)
            or (
                finished.get(u.key) == "failed"
                # this pass's failed prefetch: the unit still serves
                and not all(ctx.reasons.get(p.name, "").startswith(PREFETCH_FAILED) for p in u.pods)
            )
        ),
        max_unavailable=seen.max_unavailable,
        # claims whose drain never landed wait for a slot too (``advance``)
        waiting_for_slot=sum(1 for u in pending if u.ready) + len(ctx.undrained),
        working=bool(flying or pending) and paused_reason is None and not seen.blocked_by,
        progressed=ctx.progressed,
        clock=clock,
        now=now,
    )
    if aborted_at is None and verdict is not None:
        aborted_at, abort_reason = timestamp(now), verdict.reason
        ctx.emit(verdict.reason, verdict.message, warning=True)
    return Halt(
        aborted_at, abort_reason, paused_reason, hold_released, pending, touched, canary_done
    )
