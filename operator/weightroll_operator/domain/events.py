"""The WeightUpdate's unit-transition Events of one pass, aggregated: one Event per reason.

Unit-transition Events are aggregated per reason and pass (one Event per batch, not per pod),
which keeps API writes per pod bounded; each message still names every unit (up to a limit),
and each aggregate keeps its parts, so apply can leave out the part of a pod whose write failed
(:func:`emit_holding`). Moved out of the planner (``plan/``) unchanged (the planner builds, this
reports).
"""

from __future__ import annotations

from collections.abc import Sequence

from weightroll_operator.domain.actions import Action, Emit
from weightroll_operator.domain.conditions import Reason

__all__ = ["aggregate_emits", "aggregate_events", "emit_holding"]


#: Unit-transition Events are aggregated per reason and pass (one Event per batch, not per pod),
#: which keeps API writes per pod bounded; each message still names every unit (up to a limit).
_AGGREGATED = {
    Reason.UNIT_DRAINING,
    Reason.UNIT_VERIFIED,
    Reason.UNIT_FAILED,
    Reason.UNIT_ROLLING_BACK,
    Reason.UNIT_ROLLED_BACK,
    Reason.UNIT_RESTORED,
    Reason.UNIT_PREFETCHING,
    Reason.UNIT_PREFETCH_RELEASED,
}
_MAX_LISTED = 20


def aggregate_events(actions: list[Action]) -> tuple[Action, ...]:
    """The actions with each aggregated reason's Events made one (:func:`aggregate_emits`), at
    the place of the first."""
    grouped: dict[str, list[Emit]] = {}
    out: list[Action] = []
    for action in actions:
        if isinstance(action, Emit) and action.reason in _AGGREGATED:
            if action.reason not in grouped:
                grouped[action.reason] = []
                out.append(action)  # placeholder, replaced below
            grouped[action.reason].append(action)
        else:
            out.append(action)
    for i, action in enumerate(out):
        if isinstance(action, Emit) and action.reason in grouped:
            merged = aggregate_emits(grouped[action.reason])
            assert merged is not None
            out[i] = merged
    return tuple(out)


def aggregate_emits(emits: Sequence[Emit]) -> Emit | None:
    """One Event for ``emits`` of one reason ("3 units: ..."), keeping each as a part; ``None``
    for none. The message names up to ``_MAX_LISTED`` units."""
    if len(emits) <= 1:
        return emits[0] if emits else None
    first = emits[0]
    listed = "; ".join(e.message for e in emits[:_MAX_LISTED])
    more = f"; and {len(emits) - _MAX_LISTED} more" if len(emits) > _MAX_LISTED else ""
    return Emit(
        first.reason,
        f"{len(emits)} units: {listed}{more}"[:2000],
        any(e.warning for e in emits),
        pods=tuple(name for e in emits for name in e.pods),
        parts=tuple(emits),
    )


def emit_holding(emit: Emit, unwritten: frozenset[str]) -> Emit | None:
    """``emit`` as far as it is still true when the actions of the pods ``unwritten`` failed:
    an Event reporting one of them is left out, an aggregate keeps its other parts."""
    if not unwritten or unwritten.isdisjoint(emit.pods):
        return emit
    if not emit.parts:
        return None
    return aggregate_emits([e for e in emit.parts if unwritten.isdisjoint(e.pods)])
