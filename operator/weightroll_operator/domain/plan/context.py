"""What every step of a pass shares: its inputs, its result and the context it builds.

:class:`Fleet` and :class:`Persisted` are what :func:`~weightroll_operator.domain.plan.plan`
reads, :class:`Plan` is what it returns, :class:`PodClass` is where a pod stands, and
:class:`PassContext` is the one mutable thing of a pass: the actions, reasons and outcomes the
steps add to it, in order (as Argo Rollouts' ``rolloutContext`` is shared by its steps).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from weightroll_operator.api.v1alpha1 import Phase, WeightUpdateSpec, WeightUpdateStatus
from weightroll_operator.domain.actions import Action, Emit
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.model import (
    AgentView,
    OwnerKey,
    PodView,
    SourceRef,
    UpdateId,
    UpdateView,
    attempt_id,
)

__all__ = [
    "FAILED_CLASSES",
    "WANTING_CLASSES",
    "PREFETCH_FAILED",
    "Fleet",
    "PassContext",
    "Persisted",
    "Plan",
    "PodClass",
    "Query",
    "parse_time",
    "target_source",
    "unit_label",
]


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return _parse_time(value)


@functools.lru_cache(maxsize=4096)
def _parse_time(value: str) -> datetime:
    # Pure, and the result is immutable: a pass reads the same few timestamps on many pods.
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@dataclass(frozen=True, slots=True)
class Persisted:
    """The status fields that cannot be reconstructed from the cluster (house rule 6)."""

    target_version: str | None = None
    start_time: str | None = None
    completion_time: str | None = None
    last_progress_time: str | None = None
    aborted_at: str | None = None
    abort_reason: str | None = None
    #: The previous pass held the rollout (phase ``Paused``: ``spec.paused`` or the canary
    #: hold; or condition ``Blocked``). The pass that finds the hold released restarts the
    #: progress clock, so time on hold or blocked never counts against
    #: ``progressDeadlineSeconds``.
    held: bool = False
    #: The previous pass found the rollout finished with nothing to do (phase ``Succeeded``):
    #: the pass that finds work again (a new or restarted pod) starts the progress clock, so
    #: the convergence's progress is measured, not the time since completion (``halts``).
    idle: bool = False
    #: Persisted intent of ``weightroll retry``: settled failures (and rollbacks) of attempts
    #: that started before this time are tried again by fresh attempts.
    retried_at: str | None = None
    #: Not persisted: the progress clock never starts before this (the operator's own start),
    #: so operator downtime never counts against ``progressDeadlineSeconds``.
    clock_floor: str | None = None

    @classmethod
    def from_status(cls, status: WeightUpdateStatus | None, version: str) -> Persisted:
        """Read them from the status; a new ``spec.version`` starts from scratch."""
        if status is None or status.target_version != version:
            return cls(target_version=version)
        blocked = any(c.type == "Blocked" and c.status == "True" for c in status.conditions)
        return cls(
            target_version=version,
            start_time=status.start_time,
            completion_time=status.completion_time,
            last_progress_time=status.last_progress_time,
            aborted_at=status.aborted_at,
            abort_reason=status.abort_reason,
            held=status.phase is Phase.PAUSED or blocked,
            idle=status.phase is Phase.SUCCEEDED,
            retried_at=status.retried_at,
        )


@dataclass(frozen=True, slots=True)
class Fleet:
    """Everything observed this pass about the selected pods."""

    name: str
    owner: OwnerKey
    pods: tuple[PodView, ...]
    #: Agent observations by pod name (only the pods :func:`queries` asked for).
    agents: Mapping[str, AgentView] = field(default_factory=dict)
    #: Older, unfinished WeightUpdates selecting these pods (``domain.ownership``): no start.
    peers: tuple[str, ...] = ()
    #: Pods a younger WeightUpdate selects after this one finished (``domain.ownership``):
    #: left to it, reported ``Superseded``.
    superseded: frozenset[str] = frozenset()
    #: The WeightUpdate's ``metadata.uid`` and ``generation``: part of every attempt id.
    uid: str = ""
    generation: int = 0
    #: ``group_units(pods)``, when the caller already grouped them (it reuses the units of
    #: unchanged pods from pass to pass); ``None``: grouped here.
    units: tuple[Unit, ...] | None = None
    #: Selected pods being deleted: unit key -> the end of their grace period
    #: (``deletionTimestamp``). Until then they are out of traffic and not gone, so each such
    #: unit counts as unavailable (its replacement may not be seen yet); a pod still there after
    #: it (a lost node) no longer holds the rollout.
    terminating: Mapping[str, str] = field(default_factory=dict)

    def attempt_id(self, version: str, attempt: int, *, rollback: bool = False) -> UpdateId:
        return attempt_id(
            self.name,
            version,
            uid=self.uid,
            generation=self.generation,
            attempt=attempt,
            rollback=rollback,
        )


class PodClass(StrEnum):
    """Where one pod stands relative to this WeightUpdate's target version."""

    UPDATED = "Updated"
    PENDING = "Pending"
    IN_FLIGHT = "InFlight"
    #: Owned and still serving while its agent prefetches (``UnitState.PREFETCHING``): not in
    #: flight, not unavailable, not claimed for the drain yet.
    PREFETCHING = "Prefetching"
    FAILED = "Failed"
    ROLLED_BACK = "RolledBack"
    ROLLBACK_FAILED = "RollbackFailed"
    BLOCKED = "Blocked"
    #: Last driven by another WeightUpdate after this one completed: left alone.
    FOREIGN = "Foreign"
    #: Version unknown (agent unreachable): cannot be started.
    UNKNOWN = "Unknown"


#: Reason prefix of a unit whose prefetch failed before its drain: it serves what it served.
PREFETCH_FAILED = "PrefetchFailed: "

#: The classes of a failed pod (a failed update, or a failed rollback).
FAILED_CLASSES = frozenset({PodClass.FAILED, PodClass.ROLLBACK_FAILED})

#: The classes of a pod that still wants the version: it does not serve it (``PENDING``), or
#: it is not known to (``UNKNOWN``: its agent cannot be asked). Work left to the rollout, so
#: its unit is pending (``deadlines``) and the phase is not ``Succeeded`` (``status``).
WANTING_CLASSES = frozenset({PodClass.PENDING, PodClass.UNKNOWN})


@dataclass(frozen=True, slots=True)
class Query:
    """What to ask one pod's agent: its state, and/or one update's status."""

    state: bool
    update_id: UpdateId | None = None


def target_source(spec: WeightUpdateSpec) -> SourceRef:
    """The files ``spec.version`` is loaded from: what a verdict at the version must vouch for."""
    return SourceRef(
        uri=spec.source.uri,
        manifest=spec.source.manifest,
        manifest_digest=spec.source.manifest_digest,
    )


def unit_label(unit: Unit) -> str:
    """How Events name a unit: its pod, or its group."""
    return unit.pods[0].name if len(unit.pods) == 1 else f"group {unit.key}"


@dataclass(frozen=True, slots=True)
class Premise:
    """What the actions of one unit in a pass rest on, as a pod write rests on the
    ``resourceVersion`` it was read at: the agent answers they were decided on, and for a claim
    of a pod this WeightUpdate does not own yet, its precedence among its peers.

    The planner decides on whatever answers it is given and names its premises; it knows
    nothing of where the answers came from. The caller, which does (an earlier pass's answer
    reused, an index of WeightUpdates that may lag), checks them before applying and drops the
    unit's actions where one no longer holds (``reconcile/confirm.py``). A claim records what
    the pod serves (its rollback target) and that it runs no update, and a re-attestation or
    a withdrawal what it serves now: a trainer push changes that without touching the pod.
    """

    #: The pods whose actions (and the Events naming them) stand or fall together.
    pods: tuple[str, ...]
    #: The agent answers the actions were decided on, by pod name (``None``: not asked).
    answers: Mapping[str, AgentView | None]
    #: The actions rest on the peers too: no older WeightUpdate unseen in ``Fleet.peers``.
    peers: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do this pass and what was seen (the status is computed from it)."""

    actions: tuple[Action, ...]
    persisted: Persisted
    classes: Mapping[str, PodClass]
    #: Pods by name (the views the plan was made from).
    pods: Mapping[str, PodView]
    #: Failure reasons by pod name (failed pods, this pass's included).
    reasons: Mapping[str, str]
    #: Why a pod cannot be worked on (agent unreachable), by pod name.
    notes: Mapping[str, str]
    units_total: int
    max_unavailable: int
    paused_reason: str | None
    blocked_by: tuple[str, ...]
    #: Units whose drain starts this pass, and units finishing (for metrics): key -> outcome.
    finished: Mapping[str, str]
    #: Seconds each finished unit took, by unit key (from the recorded start).
    durations: Mapping[str, float]
    in_flight_units: int
    pending_units: int
    completed: bool
    rolling_back: bool
    rollback_remaining: int
    #: What this pass's claims, re-attestations and withdrawals rest on, one premise per unit
    #: (:class:`Premise`): the caller applies a unit's actions only while its premise holds.
    premises: tuple[Premise, ...] = ()
    #: The class each pod claimed this pass had before its claim (what it is if the claim
    #: does not happen: :func:`~.settle.unsettled`).
    claimed_from: Mapping[str, PodClass] = field(default_factory=dict)
    #: Forward steps were left for the next pass (``plan``'s ``step_limit``): run it at once.
    deferred: bool = False
    #: Where each pod being worked on stands (:func:`~.settle.pod_step`), by pod name.
    steps: Mapping[str, str] = field(default_factory=dict)


class PassContext:
    """The one mutable state of a pass: what the steps decided so far, in order.

    Each step reads the pass's inputs here (``spec``, ``fleet``, ``now``) and appends its
    actions, failure reasons and unit outcomes; :func:`~.settle.settle` turns it into the
    :class:`Plan`.
    """

    def __init__(self, spec: WeightUpdateSpec, fleet: Fleet, now: datetime) -> None:
        self.spec, self.fleet, self.now = spec, fleet, now
        self.actions: list[Action] = []
        self.reasons: dict[str, str] = {}
        self.finished: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.progressed = False
        #: ``Persisted.clock_floor``: no timer counts time before it.
        self.clock_floor: datetime | None = None
        self.step_limit = 0
        #: What the actions so far rest on (:attr:`Plan.premises`).
        self.premises: list[Premise] = []
        #: Pods this pass may still start a forward step on (``plan``'s ``step_limit``);
        #: ``None``: no limit.
        self.steps_left: int | None = None
        #: A forward step was left for the next pass by the limit (:attr:`Plan.deferred`).
        self.deferred = False
        #: In-flight units whose claim's drain never landed: they wait for a slot
        #: (``advance.drain_waiting_claims``), in traffic, and hold none until drained.
        self.undrained: list[Unit] = []

    def take_steps(self, pods: int) -> bool:
        """Spend ``pods`` forward steps (a claim, an update start, a completion, a restore of
        that many pods); False, and the step is left for the next pass, once they run out.
        Steps that drain, abort or fail are never limited: they are what keeps traffic safe."""
        if self.steps_left is None:
            return True
        if self.steps_left < pods and self.steps_left < self.step_limit:
            # Out of steps (a unit larger than the whole limit still goes alone, first).
            self.deferred = True
            return False
        self.steps_left -= pods
        return True

    def rest_on(self, pods: Iterable[PodView], *, peers: bool = False) -> None:
        """The actions this pass adds for ``pods`` rest on what their agents said (and, with
        ``peers``, on this WeightUpdate's precedence among its peers): :class:`Premise`."""
        names = tuple(p.name for p in pods)
        answers = {n: self.fleet.agents.get(n) for n in names}
        self.premises.append(Premise(pods=names, answers=answers, peers=peers))

    def answer(self, pod: PodView) -> tuple[AgentView | None, UpdateView | None]:
        """What ``pod``'s agent said this pass (``None``: not asked), and about the update
        the pass asked it for (``None``: not asked, or unknown to the agent)."""
        agent = self.fleet.agents.get(pod.name)
        return agent, (agent.update if agent is not None else None)

    def emit(
        self, reason: str, message: str, warning: bool = False, pods: Iterable[PodView] = ()
    ) -> None:
        """Post an Event; ``pods``: those whose actions of this pass it reports (``Emit.pods``)."""
        names = tuple(p.name for p in pods)
        self.actions.append(Emit(reason=reason, message=message, warning=warning, pods=names))

    def duration(self, unit: Unit) -> float | None:
        starts = [parse_time(p.state.started_at) for p in unit.pods if p.state is not None]
        known = [s for s in starts if s is not None]
        return (self.now - min(known)).total_seconds() if known else None

    def finish(self, unit: Unit, outcome: str) -> None:
        """Record that ``unit`` finished this pass (``outcome``, for metrics) and how long it
        took from its recorded start: progress."""
        self.finished[unit.key] = outcome
        d = self.duration(unit)
        if d is not None:
            self.durations[unit.key] = d
        self.progressed = True
