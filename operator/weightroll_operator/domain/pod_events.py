"""Events on pods: what ``kubectl describe pod`` says about the operator's work on that pod.

The WeightUpdate's Events tell the rollout's story (``Emit`` actions of the plan); these tell
one pod's: it was drained, its update started, it was verified at a version (traffic back), or
its update failed and why. They are derived from the pod actions that *succeeded* in a pass
(:func:`pod_event`), so an Event never claims what did not happen: no "Verified" unless the gate
write that restored traffic went through.

Aggregation, as the WeightUpdate's Events are aggregated per pass (``events.aggregate_events``):
one pass posts at most one Event per pod and reason (:func:`aggregate`); across passes an
identical Event (same pod, reason, message) raises the count of the Event already posted
instead of adding one (``apply.py``, as client-go's event correlator does, in memory).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from weightroll_operator.domain.actions import GateOff, GateOn, PodAction, Settle, StartUpdate
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY, OwnerKey, PodView, UnitState

__all__ = ["PodEvent", "PodEventReason", "aggregate", "pod_event"]


class PodEventReason(StrEnum):
    """Reasons of the Events on pods (docs/api.md, "Events on pods")."""

    #: The gate was set False: no new traffic reaches the pod.
    DRAINED = "WeightsDrained"
    #: The agent accepted the update (it drains generation, loads and verifies).
    UPDATING = "WeightsUpdating"
    #: Every rank committed the version and the gate is True again: traffic is back.
    VERIFIED = "WeightsVerified"
    #: A pod already serving the target got its traffic back (new pod, or after a restart).
    RESTORED = "WeightsServing"
    #: The update failed; the pod stays drained.
    FAILED = "WeightsUpdateFailed"


@dataclass(frozen=True, slots=True)
class PodEvent:
    """One Event to post on ``pod``."""

    pod: PodView
    reason: PodEventReason
    message: str
    warning: bool = False


def pod_event(action: PodAction, owner: OwnerKey) -> PodEvent | None:
    """The Event a succeeded ``action`` of the WeightUpdate ``owner`` means for its pod.

    Args:
        action: a pod action that was applied without error.
        owner: ``namespace/name`` of the WeightUpdate that acted.

    Returns:
        The Event, or ``None`` for actions the pod's story does not need (claims, aborts,
        settles other than a failure).
    """
    pod = action.pod
    if isinstance(action, GateOff):
        why = action.message or "Draining"
        return PodEvent(
            pod,
            PodEventReason.DRAINED,
            f"{why}: WeightUpdate {owner} set {CONDITION_WEIGHTS_READY}=False, no new traffic",
        )
    if isinstance(action, StartUpdate):
        request = action.request
        return PodEvent(
            pod,
            PodEventReason.UPDATING,
            f"Started update {request.id} to weights {request.version} ({request.mode.value}) "
            f"for WeightUpdate {owner}",
        )
    if isinstance(action, GateOn):
        if action.reason == "Verified":
            return PodEvent(
                pod,
                PodEventReason.VERIFIED,
                f"Verified weights {action.version} on every rank; traffic restored "
                f"({CONDITION_WEIGHTS_READY}=True) by WeightUpdate {owner}",
            )
        return PodEvent(
            pod,
            PodEventReason.RESTORED,
            f"Serving weights {action.version}; traffic restored ({CONDITION_WEIGHTS_READY}=True) "
            f"by WeightUpdate {owner}",
        )
    if isinstance(action, Settle) and action.transition and action.state.state is UnitState.FAILED:
        reason = action.state.reason or "unknown reason"
        return PodEvent(
            pod,
            PodEventReason.FAILED,
            f"Update to weights {action.state.version} failed: {reason}; the pod stays drained "
            f"(WeightUpdate {owner})",
            warning=True,
        )
    return None


def aggregate(events: Iterable[PodEvent]) -> list[PodEvent]:
    """At most one Event per pod and reason in one pass: the messages of repeats are joined."""
    grouped: dict[tuple[str, str, PodEventReason], list[PodEvent]] = {}
    for event in events:
        key = (event.pod.namespace, event.pod.name, event.reason)
        grouped.setdefault(key, []).append(event)
    out = []
    for same in grouped.values():
        first = same[0]
        messages = list(dict.fromkeys(e.message for e in same))
        message = "; ".join(messages)[:1000]
        out.append(PodEvent(first.pod, first.reason, message, any(e.warning for e in same)))
    return out
