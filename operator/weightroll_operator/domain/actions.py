"""Frozen actions returned by the planner and executed by ``apply.py``.

Each action touches one pod (or posts one Event). Actions of one pod run in plan order and the
chain stops at the first error, so a ``GateOn`` never runs after a failed step before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from engine_agent.protocol import UpdateRequest
from weightroll_operator.domain.model import OwnerKey, PodView, UpdateId, WeightState

__all__ = [
    "AbortUpdate",
    "Action",
    "Claim",
    "Emit",
    "GateOff",
    "GateOn",
    "PodAction",
    "Settle",
    "StartUpdate",
    "SwapUpdate",
]


@dataclass(frozen=True, slots=True)
class Claim:
    """Metadata patch: owner annotation, ``weight-state``, and drop the traffic label if set.

    Written *before* the gate so that a restarted operator knows the pod is ours and what it
    served before (the rollback target).
    """

    pod: PodView
    owner: OwnerKey
    state: WeightState
    remove_label: str | None = None


@dataclass(frozen=True, slots=True)
class GateOff:
    """Status patch: ``weightroll.io/weights-ready`` False (drains traffic)."""

    pod: PodView
    reason: str = "Draining"
    message: str = ""


@dataclass(frozen=True, slots=True)
class StartUpdate:
    """``POST /v1/updates`` on the pod's agent (idempotent by id)."""

    pod: PodView
    request: UpdateRequest


@dataclass(frozen=True, slots=True)
class AbortUpdate:
    """``POST /v1/updates/{id}/abort``; the pod stays drained."""

    pod: PodView
    update_id: UpdateId


@dataclass(frozen=True, slots=True)
class SwapUpdate:
    """``POST /v1/updates/{id}/swap``: the go for an update parked in ``Prefetched``, sent only
    once the pod is observed drained."""

    pod: PodView
    update_id: UpdateId


@dataclass(frozen=True, slots=True)
class GateOn:
    """Status patch: ``weightroll.io/weights-ready`` True, only after a Committed verdict."""

    pod: PodView
    version: str
    reason: str = "Verified"
    #: The condition's message; empty: "Weights <version> committed on every rank".
    message: str = ""


@dataclass(frozen=True, slots=True)
class Settle:
    """Metadata patch at the end of a unit operation: new ``weight-state``, labels, owner."""

    pod: PodView
    state: WeightState
    #: Remove the owner annotation (False keeps failed pods owned, so no one else takes them).
    release: bool = True
    #: Labels to set (value) or remove (None).
    labels: dict[str, str | None] = field(default_factory=dict)

    @property
    def transition(self) -> bool:
        """The record moves to another state (or to another WeightUpdate's name): a verdict, a
        failure, a withdrawal. ``False``: it keeps both and records only what the gate vouches
        for or which containers a verdict was made on, which is no new failure to count or
        announce, and leaves the pod's class as the pass saw it."""
        before = self.pod.state
        return before is None or (before.state, before.by) != (self.state.state, self.state.by)


@dataclass(frozen=True, slots=True)
class Emit:
    """An Event on the WeightUpdate (also the unit-transition log).

    An Event that reports pod writes of the same pass ("Verified ... and restored traffic",
    "Draining ...") names those pods: it is true only once every action of theirs succeeded,
    so ``apply`` posts it only then. Otherwise the next pass plans the same step again and
    says it again (a 409 on a Settle posted ``UnitVerified`` twice for one unit).
    """

    reason: str
    message: str
    warning: bool = False
    #: The pods whose actions of this pass the Event reports (empty: it reports none).
    pods: tuple[str, ...] = ()
    #: An aggregate's parts, one per unit (``events.aggregate_emits``): apply leaves out a part
    #: whose pods' actions failed and words the rest anew.
    parts: tuple[Emit, ...] = ()


PodAction: TypeAlias = Claim | GateOff | StartUpdate | SwapUpdate | AbortUpdate | GateOn | Settle
Action: TypeAlias = PodAction | Emit
