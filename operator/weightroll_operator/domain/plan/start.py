"""Steps 4 and 5b: the unavailability :func:`budget` and :func:`start_units` (new claims).

What one claim costs is ``domain.availability``'s: a unit the rollout already keeps out of
traffic (:func:`held`) is free.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from weightroll_operator.domain.availability import Slots
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.plan.claim import (
    can_claim,
    claim,
    claim_prefetched,
)
from weightroll_operator.domain.plan.classify import Seen, drained_failure
from weightroll_operator.domain.plan.context import (
    PassContext,
    PodClass,
    parse_time,
)
from weightroll_operator.domain.plan.deadlines import Halt
from weightroll_operator.domain.plan.prefetch import Staged, prefetch_ahead


def budget(
    seen: Seen,
    flying: frozenset[str],
    terminating: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> int:
    """Step 4: how many more units may become unavailable this pass.

    A unit is unavailable from its drain until its pods are observed Ready after the GateOn:
    while any pod is not Ready, it is in flight or failed, or it is seen in a view older than
    the operator's own last write to it. Starting a unit that is already unavailable is free.
    A unit with a pod being deleted (``Fleet.terminating``) is out of traffic too, whether or
    not its replacement is seen yet, until its grace period ends.
    """
    down = {
        u.key
        for u in seen.units
        if not u.ready or u.key in seen.frozen or u.key in flying or drained_failure(seen, u)
    }
    leaving = {
        key
        for key, until in (terminating or {}).items()
        if key not in down and (now is None or (parse_time(until) or now) >= now)
    }
    return seen.max_unavailable - len(down) - len(leaving)


def held(seen: Seen, flying: frozenset[str], unit: Unit) -> bool:
    """The rollout keeps ``unit`` out of traffic (``domain.availability``)."""
    return (
        unit.key in flying
        or unit.key in seen.frozen
        or unit.partly_gated_out
        or drained_failure(seen, unit)
    )


def kubelet_caught_up(unit: Unit) -> bool:
    """No pod of ``unit`` has a ``Ready`` that lags its gates (``PodView.ready_lags_gates``).

    A claim drains, and a drain is observed as ``Ready`` False: on a pod whose kubelet has not
    yet acted on our last ``GateOn``, that False is the one from before the ``GateOn``, and
    the kubelet's ``Ready`` True for the gate it last saw can still land after the drain,
    putting the pod in traffic while its update runs (a flip-back right after a restore, found
    on the real node). Such a unit is claimed once the kubelet caught up.
    """
    return not any(p.ready_lags_gates for p in unit.pods)


def startable(ctx: PassContext, seen: Seen, unit: Unit) -> bool:
    """A pending ``unit`` may be claimed: seen fresh, its kubelet caught up with its gates
    (:func:`kubelet_caught_up`), and every pod that wants the version may be
    (:func:`can_claim`)."""
    fleet = ctx.fleet
    return (
        unit.key not in seen.frozen
        and kubelet_caught_up(unit)
        and all(seen.classes[p.name] in (PodClass.PENDING, PodClass.UPDATED) for p in unit.pods)
        and all(
            can_claim(p, fleet.agents.get(p.name), fleet.owner, ctx.spec.version)
            for p in unit.pods
            if seen.classes[p.name] is PodClass.PENDING
        )
    )


def start_units(
    ctx: PassContext, seen: Seen, halt: Halt, slots: Slots, staged: Staged | None = None
) -> None:
    """Step 5b: start new units, those held out of traffic by our gate first (free), then
    while slots remain (what each claim costs: ``domain.availability``).

    The canary goes first; units never touched wait until every canary unit has a verdict
    that stands (``Halt.canary_done``), while touched units that want the version again (a
    retried canary among them) may start within the budget. Only units whose pending pods may
    be claimed (:func:`can_claim`) start. Prefetching ahead (``prefetch.prefetch_ahead``, after
    the canary) a unit in traffic is claimed only once its prefetch verified (``staged``), for
    the attempt it runs (step 5c starts the prefetches); one already out of traffic (cost < 2:
    reading ahead gains it nothing) is claimed at once, and prefetches inside its drain.
    """
    if staged is not None and prefetch_ahead(ctx.spec) and halt.canary_done:
        ready = {u.key for u in staged.ready}
        out = (u for u in halt.pending if slots.cost(u) < 2)
        for unit in sorted((*out, *staged.ready), key=lambda u: (slots.cost(u), u.key)):
            if not slots.affords(unit):
                if slots.cost(unit) == 2 or slots.rollout <= 0:
                    break  # no later unit is cheaper
                continue
            staged_here = unit.key in ready
            if not (kubelet_caught_up(unit) if staged_here else startable(ctx, seen, unit)):
                continue
            if not ctx.take_steps(len(unit.pods)):
                break
            slots.take(unit)
            if staged_here:
                claim_prefetched(ctx, unit)
                ctx.progressed = True
            else:
                claim(ctx, unit)
        return
    canary = ctx.spec.strategy.canary
    touched = {u.key for u in halt.touched}
    limit = None  # how many units never touched may start
    if canary is not None and not halt.canary_done:
        limit = max(0, canary - len(touched))

    # Free units first, then NotReady ones, then Ready ones, each group by key; the test is
    # evaluated lazily, so a pass that may start a few units does not examine every pending
    # one (the loop stops early).
    order = sorted(halt.pending, key=lambda u: (slots.cost(u), u.key))
    # touched units still to visit: once none is left, a spent limit ends the loop
    again = sum(1 for u in order if u.key in touched) if limit is not None else 0
    for unit in order:
        fresh = unit.key not in touched
        again -= not fresh
        if fresh and limit is not None and limit <= 0:
            if again <= 0:
                break
            continue
        if not slots.affords(unit):
            if slots.cost(unit) == 2 or slots.rollout <= 0:
                break  # no later unit is cheaper
            continue
        if not startable(ctx, seen, unit):
            continue
        if not ctx.take_steps(len(unit.pods)):
            break
        if fresh and limit is not None:
            limit -= 1
        slots.take(unit)
        claim(ctx, unit)
