"""Step 5a, :func:`roll_back`: a halt with ``onFailure: Rollback`` returns every touched unit to
the weights it served before (:func:`rollback_target`), within the budget.
"""

from __future__ import annotations

from weightroll_operator.domain.actions import AbortUpdate, Settle
from weightroll_operator.domain.availability import Slots
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import SourceRef, UnitState
from weightroll_operator.domain.plan.claim import claim, idle
from weightroll_operator.domain.plan.classify import Seen
from weightroll_operator.domain.plan.context import (
    PREFETCH_FAILED,
    PassContext,
    PodClass,
    unit_label,
)


def roll_back(ctx: PassContext, seen: Seen, flying: frozenset[str], slots: Slots) -> int:
    """Step 5a (halted with ``onFailure: Rollback``): roll back every touched, settled unit in
    place, within the budget; return how many units are still to roll back."""
    owner, version = ctx.fleet.owner, ctx.spec.version
    remaining = 0
    for unit in seen.units:
        if unit.key in ctx.finished:
            # A forward update that just ended still has to be rolled back (next pass).
            forward = not any(
                p.state is not None and p.state.state is UnitState.ROLLING_BACK for p in unit.pods
            )
            remaining += int(forward)
            continue
        if unit.key in flying:
            continue
        needs = [
            p
            for p in unit.pods
            if p.state is not None
            and p.state.by == owner
            and p.state.version == version
            and p.state.rollback_of is None
            and p.state.state in (UnitState.VERIFIED, UnitState.FAILED)
            # a prefetch that failed before its drain left the previous weights serving
            and not p.state.reason.startswith(PREFETCH_FAILED)
        ]
        if not needs:
            continue
        remaining += 1
        if PodClass.BLOCKED in seen.by_unit[unit.key] or unit.key in seen.frozen:
            continue
        missing = [
            p.name
            for p in unit.pods
            if p.state is None
            or p.state.previous_source is None
            or not p.state.previous_version
            or p.state.previous_version == version
        ]
        if missing:
            why = f"NoRollbackTarget: no previous version/source for {', '.join(missing)}"
            for p in needs:
                assert p.state is not None
                ctx.actions.append(
                    Settle(
                        p,
                        p.state.evolve(state=UnitState.FAILED, reason=why, rollback_of=version),
                        release=False,
                    )
                )
                ctx.reasons[p.name] = why
            message = f"Cannot roll back {unit_label(unit)}: {why}"
            ctx.emit(Reason.UNIT_FAILED, message, True, pods=needs)
            continue
        agents = ctx.fleet.agents
        if not all(idle(agents.get(p.name)) for p in unit.pods):
            # Our failed attempt still running (its abort was lost with the operator that
            # planned it) is aborted again; any other waits to end before the claim.
            ctx.actions.extend(
                AbortUpdate(p, p.state.update_id)
                for p in needs
                if p.state is not None
                and (agent := agents.get(p.name)) is not None
                and agent.reachable
                and agent.active_update_id == p.state.update_id
            )
            continue
        if not slots.affords(unit):
            continue
        if not ctx.take_steps(len(unit.pods)):
            continue
        slots.take(unit)
        claim(ctx, unit, rollback_of=version)
    return remaining


def rollback_target(ctx: PassContext) -> tuple[str, SourceRef] | None:
    """What a rollback returns the fleet to: the previous version and files every unit this
    WeightUpdate touched for its version recorded, when they agree (else ``None``)."""
    owner, version = ctx.fleet.owner, ctx.spec.version
    targets = {
        (st.previous_version, st.previous_source)
        for p in ctx.fleet.pods
        if (st := p.state) is not None
        and st.attempted_by(owner)
        and (st.version == version or st.rollback_of == version)
    }
    if len(targets) != 1:
        return None
    ((previous, source),) = targets
    return (previous, source) if previous and source is not None else None
