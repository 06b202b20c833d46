"""The rollout algorithm of record: ``plan(spec, fleet, persisted, now) -> Plan``.

Pure and level-triggered: everything it needs is in its arguments (observed pods with their
``weight-state`` annotations, what each asked agent said, the few persisted status fields), and it
returns frozen actions plus a summary for the status. Each pass moves each unit at most one step.

Per unit (one pod, or the pods sharing the ``groupBy`` label value), the steps are::

    Claim (owner + weight-state Draining: the attempt id, the previous version/source) + GateOff
      -> observe every pod NotReady (kubelet applied the gate)
      -> StartUpdate on every pod's agent (idempotent by the attempt's id)
      -> every agent's live state: the version, committed by this attempt, ready
         -> GateOn + Settle(Verified)                                         [traffic back]
      -> any agent Failed/Aborted or the unit timed out -> Settle(Failed)    [stays drained]

A pass is a short list of named steps, each a function of its inputs, one file each (table
tests in ``tests/unit/weightroll_operator/plan/test_<step>.py``): :func:`classify_fleet` ->
:func:`advance_units` -> :func:`advance_prefetches` -> :func:`deadlines` -> :func:`budget` ->
:func:`roll_back` or :func:`start_units` and :func:`start_prefetches` -> :func:`restore` ->
:func:`withdraw` -> :func:`settle`.

With ``strategy.prefetch.mode: Host`` a unit is first *staged*: recorded ``Prefetching`` and
asked to prefetch (``awaitSwap``) while it serves, outside ``maxUnavailable`` and bounded by
``prefetch.maxConcurrent``; it is claimed for the drain above only once every agent says
``Prefetched``, and the update proceeds on ``SwapUpdate`` once the drain is observed
(``prefetch.py``).

    context.py    the inputs (Fleet, Persisted), the result (Plan), PodClass, Query, and the
                  PassContext every step adds its actions to
    classify.py   step 1: where each pod stands; what to ask each agent (queries)
    advance.py    step 2: each in-flight unit one step (drained, updating, verified, failed)
    deadlines.py  step 3: pause and canary holds, halts (failure budget, progress deadline)
    prefetch.py   step 2b, prefetching units; step 5c, new prefetches (ahead of the budget)
    start.py      step 4, the unavailability budget; step 5b, new claims
    rollback.py   step 5a: a halt with ``onFailure: Rollback`` rolls touched units back
    claim.py      the claim itself, shared by steps 5a and 5b
    restore.py    steps 6 and 7: traffic back to pods serving the target; withdrawn verdicts
    settle.py     step 8: the pass's own transitions, what is persisted, the Plan

The translation of a spec into the agent's request is ``domain/wire.py``.

Invariants (each has a test in ``tests/unit/weightroll_operator/test_plan.py``):
    * ``GateOn`` is planned only for a pod whose agent's *live* state is the version the pod's
      state names, committed by the attempt the state names, and ready (:func:`serves_attempt`);
      or, for a pod not verified by this WeightUpdate, whose agent is ready at the target.
    * At most ``maxUnavailable`` units are unavailable after the pass, counting units that were
      not ready before the operator touched them, and units seen in a view older than the
      operator's own last write; a claim is free only for a unit our gate holds out of
      traffic, and the units the rollout keeps out never exceed ``maxUnavailable``
      (``domain.availability``).
    * A pod owned by another WeightUpdate is never touched, and no new unit starts while any
      selected pod is owned by another WeightUpdate (condition Blocked).
    * An attempt never runs twice and never takes another's verdict: an in-flight unit is
      resumed from its annotation, and every claim is a new attempt with its own id
      (:func:`~weightroll_operator.domain.model.attempt_id`).
    * A pod is claimed only when its agent answers at a known version, running nothing (a
      joining pod waits); a failed canary halts whatever ``maxFailedReplicas`` says.
"""

from __future__ import annotations

from datetime import datetime

from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.domain.availability import Slots, held_by_agent
from weightroll_operator.domain.events import aggregate_emits, emit_holding
from weightroll_operator.domain.halts import rolls_back
from weightroll_operator.domain.plan import deadlines, restore, settle
from weightroll_operator.domain.plan.advance import (
    advance_units,
    drain_waiting_claims,
    serves_attempt,
)
from weightroll_operator.domain.plan.classify import classify_fleet, queries
from weightroll_operator.domain.plan.context import (
    WANTING_CLASSES,
    Fleet,
    PassContext,
    Persisted,
    Plan,
    PodClass,
    Premise,
    Query,
    parse_time,
    target_source,
)
from weightroll_operator.domain.plan.prefetch import advance_prefetches, start_prefetches
from weightroll_operator.domain.plan.restore import withdraw
from weightroll_operator.domain.plan.rollback import roll_back, rollback_target
from weightroll_operator.domain.plan.settle import unsettled
from weightroll_operator.domain.plan.start import budget, held, start_units, startable
from weightroll_operator.domain.wire import build_request, check_wire

# Four steps share their module's name (classify, deadlines, restore, settle): the package binds
# the modules (as Python's import system does) and calls ``deadlines.deadlines``, so
# ``weightroll_operator.domain.plan.settle`` means one thing wherever it is named.
__all__ = [
    "WANTING_CLASSES",
    "Fleet",
    "Persisted",
    "Plan",
    "PodClass",
    "Premise",
    "Query",
    "aggregate_emits",
    "build_request",
    "check_wire",
    "emit_holding",
    "parse_time",
    "plan",
    "queries",
    "target_source",
    "serves_attempt",
    "unsettled",
]

#: The step limit is never below the units divided by this. A pass walks every pod anyway
#: (classify, budget, status: a few microseconds each), so forward steps on a share of the
#: units add to its time about in proportion to that walk, while a fixed limit alone makes a
#: batch of ``maxUnavailable`` units take ``batch / limit`` passes, each walking the whole
#: fleet: at 100,000 pods and 10 % a batch was 40 passes per step (claim, start, complete) of
#: over a second each, and the rollout ran at many times its ideal (issue 27 C). With this
#: share a batch takes the same number of passes whatever the fleet size; at 10,000 pods the
#: share (250) is the default ``burst``.
STEP_SHARE = 40


def plan(
    spec: WeightUpdateSpec,
    fleet: Fleet,
    persisted: Persisted,
    now: datetime,
    *,
    step_limit: int | None = None,
) -> Plan:
    """Compute this pass's actions. Pure: same inputs, same plan.

    The pass is a short list of named steps: :func:`classify_fleet` -> :func:`advance_units`
    -> :func:`deadlines` -> :func:`budget` -> :func:`roll_back` or :func:`start_units` ->
    :func:`restore` -> :func:`withdraw` -> :func:`settle`.

    Args:
        spec: the parsed, valid spec.
        fleet: the selected pods and the agent observations :func:`queries` asked for.
        persisted: the persisted status fields (see :class:`Persisted`).
        now: the current time (UTC, timezone-aware).
        step_limit: the most pods this pass starts a forward step on (claims, update starts,
            completions, restores; a unit is never split); the rest wait for the next pass
            (:attr:`Plan.deferred`). Drains, aborts and failures are never limited. It bounds
            the time of one pass, as the ReplicaSet controller's ``burstReplicas`` does: at
            10,000 pods one batch is 1,000 units. It is never below one ``STEP_SHARE``-th of
            the units (see there). ``None``: no limit.

    Returns:
        The plan; its actions must be applied in order per pod, each unit's only while its
        :attr:`Plan.premises` hold (the agents still say what they said, the peers are the
        same: ``reconcile/confirm.py``).
    """
    ctx = PassContext(spec, fleet, now)
    ctx.clock_floor = parse_time(persisted.clock_floor)
    seen = classify_fleet(spec, fleet, persisted)
    if step_limit is not None:
        ctx.steps_left = ctx.step_limit = max(1, step_limit, len(seen.units) // STEP_SHARE)
    flying = advance_units(ctx, seen)
    staged = advance_prefetches(ctx, seen, halted=persisted.aborted_at is not None)
    # prefetching units are at work (progress deadline) and not a verdict (canary)
    halt = deadlines.deadlines(ctx, seen, persisted, flying | staged.keys)
    # claims whose drain never landed are in flight but still in traffic: no slot held yet
    out = flying - {u.key for u in ctx.undrained}
    slots = Slots.of(
        seen.max_unavailable,
        budget(seen, out, fleet.terminating, now),
        (u for u in seen.units if held(seen, out, u)),
        # a NotReady unit its agents keep out until an update is as free as one our gate holds
        (u.key for u in seen.units if not u.ready and held_by_agent(u, fleet.agents)),
    )
    drain_waiting_claims(ctx, slots, halt.aborted_at is not None)
    rollback = halt.aborted_at is not None and rolls_back(
        spec.strategy,
        finished=persisted.completion_time is not None,
        abort_reason=halt.abort_reason,
    )
    remaining = 0
    if rollback:
        remaining = roll_back(ctx, seen, flying, slots)
    elif halt.aborted_at is None and halt.paused_reason is None and not seen.blocked_by:
        start_units(ctx, seen, halt, slots, staged)
        # only units in traffic read ahead: one out of traffic was claimed above
        start_prefetches(
            ctx, seen, halt, staged, lambda u: slots.cost(u) == 2 and startable(ctx, seen, u)
        )
    restore.restore(ctx, seen, rollback_target(ctx) if rollback else None)
    withdraw(ctx)
    return settle.settle(ctx, seen, persisted, flying, halt, rollback, remaining)
