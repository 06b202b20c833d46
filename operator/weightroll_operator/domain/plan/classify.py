"""Step 1, :func:`classify_fleet`: where each pod stands, before the pass does anything.

Also what to ask each agent (:func:`queries`, before the pass) and the verdict rules the later
steps share: a verdict at the version from the spec's files (:func:`verified_at`), an agent
serving them (:func:`serves`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weightroll_operator.api.v1alpha1 import WeightUpdateSpec, resolve_max_unavailable
from weightroll_operator.domain.fleet import Unit, group_units
from weightroll_operator.domain.model import (
    AgentView,
    OwnerKey,
    PodView,
    SourceRef,
    UnitState,
    WeightState,
)
from weightroll_operator.domain.plan.context import (
    FAILED_CLASSES,
    Fleet,
    Persisted,
    PodClass,
    Query,
    parse_time,
    target_source,
)
from weightroll_operator.domain.standing import contradicts, outlived

#: The most common query (frozen, so one instance serves every pod).
_ASK_STATE = Query(state=True)
#: A pod a younger WeightUpdate selects after this one finished is no work of this one
#: (``domain.ownership``), unless it already serves this version in traffic.
_YIELDED = frozenset({PodClass.PENDING, PodClass.UNKNOWN, PodClass.UPDATED})
_SERVING = (PodClass.UPDATED, True)
#: The class set of a one-pod unit (most units): built once, not once per unit and pass.
_ONE_CLASS = {c: frozenset((c,)) for c in PodClass}
#: The classes whose units ``Seen`` lists apart (in flight, prefetching, failed).
_LISTED = frozenset({PodClass.IN_FLIGHT, PodClass.PREFETCHING} | FAILED_CLASSES)


def queries(
    pods: tuple[PodView, ...],
    owner: OwnerKey,
    version: str,
    source: SourceRef,
    retried_at: str | None = None,
) -> dict[str, Query]:
    """Which agents to ask what, so a pass contacts only the pods whose state is not settled.

    A unit that failed here is asked too: a rollback claims it only on an answer of this pass
    that its agent runs nothing (``claim.idle``), and its failed attempt may still run.
    """
    result: dict[str, Query] = {}
    for pod in pods:
        st = pod.state
        if pod.owner is not None and pod.owner != owner:
            continue
        if st is not None and st.by == owner and pod.owner == owner and st.state.running:
            result[pod.name] = Query(state=False, update_id=st.update_id)
        elif verified_at(st, version, source):
            # A verdict stands only while the agent still says so (``domain.standing``): a
            # verified pod is asked too; one in traffic is answered from the reconciler's
            # cache for at most its state TTL.
            result[pod.name] = _ASK_STATE
        elif (
            st is not None
            and st.by == owner
            and _settled_here(st, version, retried_at)
            and st.state is not UnitState.FAILED
        ):
            continue
        else:
            result[pod.name] = _ASK_STATE
    return result


def verified_at(
    st: WeightState | None, version: str, source: SourceRef, *, legacy: bool = False
) -> bool:
    """A verdict at ``version`` loaded from ``source``. One from other files labelled the same
    (``spec.source`` changed together with the version and back) is no verdict for this spec:
    the pod is asked and updated again. A record older than the source field names none: its
    agent is asked every pass; with ``legacy`` it stands while the agent cannot be asked, as it
    did when it was written (else one missed answer after an upgrade would make a Succeeded
    fleet's pod wanted again, and past the progress deadline halt or roll back the fleet)."""
    return (
        st is not None
        and st.state is UnitState.VERIFIED
        and st.version == version
        and ((legacy and st.source is None) or source.same_files(st.source))
    )


def serves(agent: AgentView | None, version: str, source: SourceRef) -> bool:
    """The agent answers, ready, serving ``version`` from ``source`` (an unknown source, as
    after a trainer push or a restart onto unrecorded boot weights, is not ``source``)."""
    return (
        agent is not None
        and agent.reachable
        and agent.version == version
        and agent.ready
        and source.same_files(agent.source)
    )


def spelled(source: SourceRef | None) -> str:
    if source is None:
        return "unrecorded files"
    text = source.uri if source.manifest is None else f"{source.uri} (manifest {source.manifest})"
    return text if source.manifest_digest is None else f"{text} pinned {source.manifest_digest}"


def _retried(st: WeightState, retried_at: str | None) -> bool:
    """``weightroll retry`` came after this settled attempt started: try the pod again."""
    retried = parse_time(retried_at)
    if retried is None:
        return False
    started = parse_time(st.started_at)
    return started is None or started <= retried


def rollback_recorded(
    st: WeightState | None, owner: OwnerKey, version: str, retried_at: str | None
) -> bool:
    """``st`` is ``owner``'s rollback from ``version`` (running, rolled back or failed) that no
    ``weightroll retry`` came after: the rollout of ``version`` halted (``halts``, "A halt is
    written on the pods too")."""
    return (
        st is not None
        and st.by == owner
        and st.rollback_of == version
        and not _retried(st, retried_at)
    )


def _settled_here(st: WeightState, version: str, retried_at: str | None = None) -> bool:
    if _retried(st, retried_at):
        return False
    if st.state is UnitState.FAILED:
        return st.version == version or st.rollback_of == version
    return st.state is UnitState.ROLLED_BACK and st.rollback_of == version


def classify(
    pod: PodView,
    agent: AgentView | None,
    owner: OwnerKey,
    version: str,
    source: SourceRef,
    completed: bool,
    retried_at: str | None = None,
) -> PodClass:
    """Classify one pod (see :class:`PodClass`); ``source`` is where ``version`` is loaded from:
    a pod serving the version label from other files is not updated."""
    st = pod.state
    if pod.owner is not None and pod.owner != owner:
        return PodClass.BLOCKED
    if st is not None and st.by == owner:
        if pod.owner == owner and st.state.in_flight:
            return PodClass.IN_FLIGHT
        if pod.owner == owner and st.state is UnitState.PREFETCHING:
            return PodClass.PREFETCHING
        if st.state in (UnitState.FAILED, UnitState.ROLLED_BACK) and _retried(st, retried_at):
            # retried: a settled failure (or rollback) is pending again, tried by a new attempt
            reachable = agent is not None and agent.reachable
            if serves(agent, version, source):
                return PodClass.UPDATED
            return PodClass.PENDING if reachable else PodClass.UNKNOWN
        if st.state is UnitState.FAILED and st.rollback_of == version:
            return PodClass.ROLLBACK_FAILED
        if st.state is UnitState.FAILED and st.version == version:
            return PodClass.FAILED
        if st.state is UnitState.ROLLED_BACK and st.rollback_of == version:
            return PodClass.ROLLED_BACK
    reachable = agent is not None and agent.reachable
    # An agent at the version that is not ready (held, paused, or poisoned after a failed push),
    # or serving it from other files, no longer vouches for the verdict: updated again.
    if (
        not reachable
        and verified_at(st, version, source, legacy=True)
        and outlived(st, pod, agent, owner) is None
    ):
        return PodClass.UPDATED
    if serves(agent, version, source) and not contradicts(st, agent, owner):
        return PodClass.UPDATED
    # another update's attempt took the pod (an Attested record of theirs only vouched for a
    # gate: the pod is as free as one with no record)
    if st is not None and st.by != owner and st.attempted_by(st.by) and completed:
        return PodClass.FOREIGN
    if not reachable:
        return PodClass.UNKNOWN
    return PodClass.PENDING


@dataclass(frozen=True, slots=True)
class Seen:
    """Step 1, :func:`classify_fleet`: what the pass sees, before it does anything."""

    units: tuple[Unit, ...]
    classes: Mapping[str, PodClass]
    #: The classes of each unit's pods, by unit key.
    by_unit: Mapping[str, frozenset[PodClass]]
    blocked_by: tuple[str, ...]
    max_unavailable: int
    #: Units with a pod seen before the operator's own last write to it: no step this pass,
    #: and unavailable.
    frozen: frozenset[str]
    #: Failure reasons recorded on the pods of failed units.
    reasons: Mapping[str, str]
    #: The units with an in-flight pod, and with a prefetching one, in ``units`` order: the
    #: steps that move them walk these few, not every unit of the fleet each pass.
    in_flight: tuple[Unit, ...]
    prefetching: tuple[Unit, ...]
    #: The keys of the units with a failed pod (``FAILED_CLASSES``).
    failing: frozenset[str]


def classify_fleet(spec: WeightUpdateSpec, fleet: Fleet, persisted: Persisted) -> Seen:
    """Step 1: classify every pod (:func:`classify`) and group them into units."""
    owner, version, source = fleet.owner, spec.version, target_source(spec)
    units = fleet.units if fleet.units is not None else group_units(fleet.pods)
    completed = persisted.completion_time is not None
    retried_at, agents = persisted.retried_at, fleet.agents
    # One walk over the pods (at 10,000 pods each walk costs about a millisecond).
    classes: dict[str, PodClass] = {}
    reasons: dict[str, str] = {}
    blocked: set[str] = set()
    frozen: set[str] = set()
    for p in fleet.pods:
        cls = classify(p, agents.get(p.name), owner, version, source, completed, retried_at)
        if p.name in fleet.superseded and cls in _YIELDED and (cls, p.gate) != _SERVING:
            cls = PodClass.FOREIGN
        classes[p.name] = cls
        if cls in FAILED_CLASSES and p.state is not None:
            reasons[p.name] = p.state.reason
        elif cls is PodClass.BLOCKED:
            blocked.add(str(p.owner))
        if p.stale:
            frozen.add(p.unit)
    by_unit: dict[str, frozenset[PodClass]] = {}
    in_flight: list[Unit] = []
    prefetching: list[Unit] = []
    failing: set[str] = set()
    for u in units:
        if len(u.pods) == 1:
            of_unit = _ONE_CLASS[classes[u.pods[0].name]]
        else:
            of_unit = frozenset(classes[p.name] for p in u.pods)
        by_unit[u.key] = of_unit
        if of_unit.isdisjoint(_LISTED):
            continue  # most units: pending or updated
        if PodClass.IN_FLIGHT in of_unit:
            in_flight.append(u)
        if PodClass.PREFETCHING in of_unit:
            prefetching.append(u)
        if not of_unit.isdisjoint(FAILED_CLASSES):
            failing.add(u.key)
    return Seen(
        units=units,
        classes=classes,
        by_unit=by_unit,
        in_flight=tuple(in_flight),
        prefetching=tuple(prefetching),
        failing=frozenset(failing),
        blocked_by=tuple(sorted(blocked | set(fleet.peers))),
        max_unavailable=resolve_max_unavailable(spec.strategy.max_unavailable, max(1, len(units))),
        frozen=frozenset(frozen),
        reasons=reasons,
    )


def drained_failure(seen: Seen, unit: Unit) -> bool:
    """``unit`` failed and the rollout keeps it out of traffic: every failure but one whose
    prefetch failed before its drain (``prefetch``): Ready, each gate open, it still serves."""
    if unit.key not in seen.failing:
        return False
    return not (unit.ready and all(p.has_gate and p.gate is True for p in unit.pods))
