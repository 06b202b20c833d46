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

A pass is a short list of named steps, each a function of its inputs (table tests in
``tests/unit/weightroll_operator/test_plan_steps.py``): :func:`classify_fleet` ->
:func:`advance_units` -> :func:`deadlines` -> :func:`budget` -> :func:`roll_back` or
:func:`start_units` -> :func:`restore` -> :func:`withdraw` -> :func:`settle`.

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

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import ValidationError

from engine_agent.protocol import DrainMode as WireDrainMode
from engine_agent.protocol import DrainSpec as WireDrainSpec
from engine_agent.protocol import SourceSpec as WireSourceSpec
from engine_agent.protocol import UpdateMode, UpdatePhase, UpdateRequest
from weightroll_operator.api.v1alpha1 import (
    OnFailure,
    Phase,
    SourceMode,
    WeightUpdateSpec,
    WeightUpdateStatus,
    resolve_max_unavailable,
)
from weightroll_operator.domain.actions import (
    AbortUpdate,
    Action,
    Claim,
    Emit,
    GateOff,
    GateOn,
    Settle,
    StartUpdate,
)
from weightroll_operator.domain.availability import Slots, held_by_agent
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.events import aggregate_emits, aggregate_events, emit_holding
from weightroll_operator.domain.fleet import Unit, group_units
from weightroll_operator.domain.halts import halt_verdict, progress_clock
from weightroll_operator.domain.model import (
    LABEL_WEIGHT_VERSION,
    AgentView,
    OwnerKey,
    PodView,
    SourceRef,
    UnitState,
    UpdateId,
    WeightState,
    attempt_id,
    make_update_id,
)
from weightroll_operator.domain.standing import contradicts, withdrawal
from weightroll_operator.domain.unit_timeout import ABORT_GRACE_SECONDS, aborted_reason, on_timeout

__all__ = [
    "Fleet",
    "Persisted",
    "Plan",
    "PodClass",
    "Query",
    "aggregate_emits",
    "build_request",
    "check_wire",
    "classify",
    "emit_holding",
    "parse_time",
    "plan",
    "queries",
    "target_source",
    "serves_attempt",
    "unsettled",
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
    #: Pods whose agent answer is an earlier pass's (cached): they are not claimed on it.
    cached: frozenset[str] = frozenset()
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
    FAILED = "Failed"
    ROLLED_BACK = "RolledBack"
    ROLLBACK_FAILED = "RollbackFailed"
    BLOCKED = "Blocked"
    #: Last driven by another WeightUpdate after this one completed: left alone.
    FOREIGN = "Foreign"
    #: Version unknown (agent unreachable): cannot be started.
    UNKNOWN = "Unknown"


@dataclass(frozen=True, slots=True)
class Query:
    """What to ask one pod's agent: its state, and/or one update's status."""

    state: bool
    update_id: UpdateId | None = None


#: The most common query (frozen, so one instance serves every pod).
_ASK_STATE = Query(state=True)
_FAILED_CLASSES = frozenset({PodClass.FAILED, PodClass.ROLLBACK_FAILED})
#: The classes of a completed rollout: failed within the tolerance (else it halted) or done.
_DONE = frozenset({PodClass.UPDATED, PodClass.FOREIGN, PodClass.FAILED})
#: The classes :func:`_notes` may say something about.
_NOTED = frozenset({PodClass.UNKNOWN, PodClass.PENDING, PodClass.IN_FLIGHT})
#: A unit is pending (still to start) when its pods are only in these classes ...
_STARTABLE = frozenset({PodClass.PENDING, PodClass.UPDATED, PodClass.UNKNOWN})
#: ... and at least one of them still wants the version.
_WANTING = frozenset({PodClass.PENDING, PodClass.UNKNOWN})


def target_source(spec: WeightUpdateSpec) -> SourceRef:
    """The files ``spec.version`` is loaded from: what a verdict at the version must vouch for."""
    return SourceRef(
        uri=spec.source.uri,
        manifest=spec.source.manifest,
        manifest_digest=spec.source.manifest_digest,
    )


def queries(
    pods: tuple[PodView, ...],
    owner: OwnerKey,
    version: str,
    source: SourceRef,
    retried_at: str | None = None,
) -> dict[str, Query]:
    """Which agents to ask what, so a pass contacts only the pods whose state is not settled."""
    result: dict[str, Query] = {}
    for pod in pods:
        st = pod.state
        if pod.owner is not None and pod.owner != owner:
            continue
        if st is not None and st.by == owner and pod.owner == owner and st.state.in_flight:
            result[pod.name] = Query(state=False, update_id=st.update_id)
        elif _verified_at(st, version, source):
            # A verdict stands only while the agent still says so (``domain.standing``): a
            # verified pod is asked too; one in traffic is answered from the reconciler's
            # cache for at most its state TTL.
            result[pod.name] = _ASK_STATE
        elif st is not None and st.by == owner and _settled_here(st, version, retried_at):
            continue
        else:
            result[pod.name] = _ASK_STATE
    return result


def _verified_at(
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


def _serves(agent: AgentView | None, version: str, source: SourceRef) -> bool:
    """The agent answers, ready, serving ``version`` from ``source`` (an unknown source, as
    after a trainer push or a restart onto unrecorded boot weights, is not ``source``)."""
    return (
        agent is not None
        and agent.reachable
        and agent.version == version
        and agent.ready
        and source.same_files(agent.source)
    )


def _spelled(source: SourceRef | None) -> str:
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
        if _retried(st, retried_at) and st.state in (UnitState.FAILED, UnitState.ROLLED_BACK):
            # retried: a settled failure (or rollback) is pending again, tried by a new attempt
            reachable = agent is not None and agent.reachable
            if _serves(agent, version, source):
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
    if not reachable and _verified_at(st, version, source, legacy=True):
        return PodClass.UPDATED
    if _serves(agent, version, source) and not contradicts(st, agent, owner):
        return PodClass.UPDATED
    if st is not None and st.by != owner and completed:
        return PodClass.FOREIGN
    if not reachable:
        return PodClass.UNKNOWN
    return PodClass.PENDING


def check_wire(spec: WeightUpdateSpec, name: str) -> None:
    """Specs the CRD schema cannot check: the source must be expressible on the agent wire.

    Raises:
        ValueError: naming ``spec.source`` and what the agent's protocol refuses in it.
    """
    probe = WeightState(
        state=UnitState.DRAINING,
        by=OwnerKey("-"),
        version=spec.version,
        update_id=make_update_id(name, spec.version),
    )
    try:
        build_request(spec, probe)
    except ValidationError as e:
        message = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise ValueError(f"spec.source: {message}") from e


def build_request(
    spec: WeightUpdateSpec, st: WeightState, *, rollback: bool = False
) -> UpdateRequest:
    """The agent request for one pod's current operation.

    Raises:
        ValueError: if the source cannot be expressed on the wire (reported as InvalidSpec).
    """
    drain = WireDrainSpec(
        mode=WireDrainMode(spec.strategy.drain.mode.value),
        timeout_seconds=spec.strategy.drain.timeout_seconds,
    )
    if rollback:
        if st.previous_source is None:
            raise ValueError("no rollback source recorded")
        return UpdateRequest(
            id=st.update_id,
            version=st.version,
            source=WireSourceSpec(
                uri=st.previous_source.uri,
                manifest=st.previous_source.manifest,
                manifest_digest=st.previous_source.manifest_digest,
            ),
            mode=UpdateMode.FULL,
            drain=drain,
        )
    sparse = spec.source.mode is SourceMode.SPARSE
    return UpdateRequest(
        id=st.update_id,
        version=st.version,
        source=WireSourceSpec(
            uri=spec.source.uri,
            manifest=spec.source.manifest,
            manifest_digest=spec.source.manifest_digest,
        ),
        mode=UpdateMode.SPARSE if sparse else UpdateMode.FULL,
        base_version=spec.source.base_version if sparse else None,
        drain=drain,
    )


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
    #: Pods a claim needs a fresh agent answer for: ask them afresh and plan again. In a
    #: ``provisional`` plan they are claimed already, on their cached answers: the plan holds
    #: only if the fresh answers equal those.
    refresh: frozenset[str] = frozenset()
    #: Forward steps were left for the next pass (``plan``'s ``step_limit``): run it at once.
    deferred: bool = False


class _Builder:
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
        #: Pods a claim waits for a fresh agent answer for (:attr:`Plan.refresh`).
        self.refresh: set[str] = set()
        #: Pods this pass may still start a forward step on (``plan``'s ``step_limit``);
        #: ``None``: no limit.
        self.steps_left: int | None = None
        #: A forward step was left for the next pass by the limit (:attr:`Plan.deferred`).
        self.deferred = False
        #: Claims may rest on cached answers (``plan``'s ``provisional``).
        self.provisional = False

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


def _unit_label(unit: Unit) -> str:
    return unit.pods[0].name if len(unit.pods) == 1 else f"group {unit.key}"


def serves_attempt(agent: AgentView, st: WeightState) -> bool:
    """The agent's *live* state is ``st.version``, committed by this attempt (``st.update_id``).

    Either the agent's record of the attempt says Committed, or it lost the record (restarted);
    in both cases its ranks must serve the version now, clean and resumed (``ready``), with the
    commit attributed to this attempt. An old verdict (a flip back, a re-created WeightUpdate)
    names another id and never counts.
    """
    live = (
        agent.reachable
        and agent.ready
        and agent.version == st.version
        and agent.committed_update_id == st.update_id
        and agent.active_update_id in (None, st.update_id)
    )
    update = agent.update
    if update is None:
        return live
    return (
        update.phase is UpdatePhase.COMMITTED
        and update.committed
        and update.version == st.version
        and live
    )


def _can_claim(pod: PodView, agent: AgentView | None, owner: OwnerKey, version: str) -> bool:
    """Claim only a pod whose agent answers at a known version (``AgentView.claimable``), or
    one this WeightUpdate already tried at this version (a retry: its previous weights are
    known) whose ranks answer but disagree on the version (a failed commit left them mixed).

    Never a booting one (vLLM not answering), whoever tried it before: the claim would count
    its boot time against the update timer, fail the unit and, with ``onFailure: Rollback``,
    roll the fleet back.
    """
    if agent is None or not agent.reachable or agent.active_update_id:
        return False
    if agent.claimable:
        return True
    st = pod.state
    return (
        agent.engine_seen
        and st is not None
        and st.by == owner
        and st.version == version
        and st.rollback_of is None
        and bool(st.previous_version)
    )


def _advance_in_flight(b: _Builder, unit: Unit) -> bool:
    """Move one in-flight unit one step; return True while it stays in flight."""
    spec, now, owner = b.spec, b.now, b.fleet.owner
    flying = [
        p for p in unit.pods if p.state is not None and p.owner == owner and p.state.state.in_flight
    ]
    rollback = any(p.state is not None and p.state.state is UnitState.ROLLING_BACK for p in flying)
    label = _unit_label(unit)
    agents = b.fleet.agents
    # Whether each pod's agent serves this pod's attempt now (:func:`serves_attempt`).
    committed: dict[str, bool] = {}
    for pod in flying:
        agent = agents.get(pod.name)
        committed[pod.name] = (
            agent is not None and pod.state is not None and serves_attempt(agent, pod.state)
        )

    # A restart between GateOn and Settle leaves the gate True on a committed unit: finish it
    # below instead of draining it again. Anything else with the gate not False is re-drained.
    all_committed = all(committed.values())
    for pod in flying:
        if pod.gate is not False and not all_committed:
            b.actions.append(GateOff(pod, message=f"Draining for weights {pod.state.version}"))  # type: ignore[union-attr]
    drained = all_committed or all(
        p.gate is False and (not p.ready or not p.has_gate) for p in flying
    )
    timeout = timedelta(seconds=spec.strategy.update_timeout_seconds)
    started = [parse_time(p.state.started_at) for p in flying if p.state is not None]
    claimed_at = min((s for s in started if s is not None), default=now)
    # Time the operator was down (or not the leader) is not the unit's: its timers start no
    # earlier than this process began to act (``Persisted.clock_floor``).
    floor = b.clock_floor
    if floor is not None and floor > claimed_at:
        claimed_at = floor
    if not drained:
        if now >= claimed_at + timeout:
            return _fail_unit(b, unit, flying, "DrainTimeout: the pods were not observed NotReady")
        return True

    def timed_out(pod: PodView, grace: float = 0.0) -> bool:
        # The update timer starts when the agent accepted the update (its record's startedAt);
        # before that (not accepted yet), at the claim.
        agent = agents.get(pod.name)
        update = agent.update if agent is not None else None
        accepted = parse_time(update.started_at) if update is not None else None
        if accepted is not None and floor is not None and floor > accepted:
            accepted = floor
        return now >= (accepted or claimed_at) + timeout + timedelta(seconds=grace)

    running: list[PodView] = []
    #: Pods given a fresh attempt this pass: their timer is the new attempt's (it starts now),
    #: never the superseded one's.
    retargeted: list[PodView] = []
    failed: dict[str, str] = {}
    for pod in flying:
        st = pod.state
        assert st is not None
        agent = agents.get(pod.name)
        update = agent.update if agent is not None else None
        if agent is None or not agent.reachable:
            running.append(pod)
        elif committed[pod.name]:
            continue
        elif (
            update is None
            and not rollback
            and agent.active_update_id != st.update_id
            and _outdated(spec, st)
        ):
            # spec.version (or with it the source) changed before this pod's update started:
            # retarget it instead of sending the old version with the new source, or recording
            # the old source for the new files.
            _retarget(b, pod, st)
            retargeted.append(pod)
        elif update is None:
            if agent.active_update_id != st.update_id and b.take_steps(1):
                b.actions.append(StartUpdate(pod, build_request(spec, st, rollback=rollback)))
            running.append(pod)
        elif update.phase is UpdatePhase.COMMITTED and update.version != st.version:
            failed[pod.name] = f"CommittedWrongVersion: agent committed {update.version}"
        elif update.phase is UpdatePhase.COMMITTED and (
            agent.version == st.version and agent.committed_update_id == st.update_id
        ):
            running.append(pod)  # committed and served, not resumed yet: wait for ready
        elif update.phase is UpdatePhase.COMMITTED:
            # Committed, but the ranks do not serve it now (vLLM restarted after the commit):
            # this attempt cannot vouch for the pod; a fresh attempt reloads it (still drained).
            again = st.evolve(
                update_id=b.fleet.attempt_id(st.version, st.attempt + 1, rollback=rollback),
                attempt=st.attempt + 1,
                reason=f"NotServingCommit: ranks serve {agent.version or 'an unknown version'}",
            )
            b.actions.append(Claim(pod, owner, again))
            b.progressed = True
            running.append(pod)
        elif update.phase is UpdatePhase.ABORTED:
            why = "; ".join(update.reasons) or update.phase.value
            failed[pod.name] = aborted_reason(why, timed_out=timed_out(pod))
        elif update.phase.terminal:
            why = "; ".join(update.reasons) or update.phase.value
            failed[pod.name] = f"Update{update.phase.value}: {why}"
        else:
            running.append(pod)
    # past the timeout: the verdict is the agent's answer to our abort (``unit_timeout``)
    aborts_after: list[PodView] = []
    if running and any(timed_out(p) for p in running):
        waiting = []
        for pod in running:
            assert pod.state is not None
            step = on_timeout(agents.get(pod.name), overdue=timed_out(pod, ABORT_GRACE_SECONDS))
            if step.reason is None:
                b.actions.append(AbortUpdate(pod, pod.state.update_id))
                waiting.append(pod)
                continue
            failed[pod.name] = step.reason
            if step.abort:
                aborts_after.append(pod)
        running = waiting
    if running or retargeted:
        return True
    if (
        failed
        and not rollback
        and all(p.state is not None and _outdated(spec, p.state) for p in flying)
    ):
        # The attempt failed at a version the spec no longer names (spec.version changed, or
        # was reverted, while it ran): no verdict on this spec, so neither a failed unit nor
        # a failure against maxFailedReplicas (it halted a reverted rollout that every pod
        # served, found by the simulation tier). As a committed outdated attempt is, the unit
        # is retargeted: a fresh attempt at the spec's version, still drained.
        for pod in flying:
            assert pod.state is not None
            if pod.gate is not False:
                b.actions.append(GateOff(pod, message=f"Draining for weights {spec.version}"))
            _retarget(b, pod, pod.state)
        b.actions.extend(AbortUpdate(p, p.state.update_id) for p in aborts_after if p.state)
        return True
    if failed:
        reason = "; ".join(
            why if len(flying) == 1 else f"{name}: {why}" for name, why in sorted(failed.items())
        )
        _fail_unit(b, unit, flying, reason)
        # after the Settle: a failed abort call must not hold the recorded verdict back
        b.actions.extend(AbortUpdate(p, p.state.update_id) for p in aborts_after if p.state)
        return False
    if not rollback and any(p.state is not None and _outdated(spec, p.state) for p in flying):
        # Committed a version the spec no longer wants (spec.version reverted mid-load, issue
        # 27 item 8): never restored at it; a fresh attempt at the spec's version, drained.
        for pod in flying:
            assert pod.state is not None
            if pod.gate is not False:
                b.actions.append(GateOff(pod, message=f"Draining for weights {spec.version}"))
            _retarget(b, pod, pod.state)
        return True
    if not b.take_steps(len(flying)):
        return True  # completed next pass (still drained: in flight until then)
    # Every pod of the unit committed at the version its state names: restore traffic.
    tl = spec.strategy.traffic_label
    for pod in flying:
        st = pod.state
        assert st is not None
        done = UnitState.ROLLED_BACK if rollback else UnitState.VERIFIED
        labels: dict[str, str | None] = {LABEL_WEIGHT_VERSION: st.version}
        if tl and st.traffic_label_value is not None:
            labels[tl] = st.traffic_label_value
        if pod.gate is not True:
            b.actions.append(GateOn(pod, version=st.version))
        b.actions.append(
            Settle(pod, st.evolve(state=done, reason="", started_at=st.started_at), labels=labels)
        )
    version = flying[0].state.version if flying[0].state else "?"
    if rollback:
        b.emit(Reason.UNIT_ROLLED_BACK, f"Rolled back {label} to {version}", pods=flying)
        b.finished[unit.key] = "rolled_back"
    else:
        b.emit(
            Reason.UNIT_VERIFIED,
            f"Verified {label} at {version} and restored traffic",
            pods=flying,
        )
        b.finished[unit.key] = "succeeded"
    d = b.duration(unit)
    if d is not None:
        b.durations[unit.key] = d
    b.progressed = True
    return False


def _outdated(spec: WeightUpdateSpec, st: WeightState) -> bool:
    """The attempt ``st`` loads what the spec no longer wants (another version, other files):
    a unit's target is the spec's until the unit is back in traffic."""
    return st.version != spec.version or not target_source(spec).same_files(st.source)


def _retarget(b: _Builder, pod: PodView, st: WeightState) -> None:
    """A fresh attempt at the spec's version for an in-flight pod, keeping the previous weights
    it recorded (what a rollback returns to)."""
    spec = b.spec
    retarget = st.evolve(
        version=spec.version,
        source=target_source(spec),
        update_id=b.fleet.attempt_id(spec.version, st.attempt + 1),
        attempt=st.attempt + 1,
        started_at=timestamp(b.now),
    )
    b.actions.append(Claim(pod, b.fleet.owner, retarget))
    b.progressed = True


def _fail_unit(b: _Builder, unit: Unit, flying: list[PodView], reason: str) -> bool:
    rollback = any(p.state is not None and p.state.state is UnitState.ROLLING_BACK for p in flying)
    for pod in flying:
        st = pod.state
        assert st is not None
        # Failed units stay drained and owned: no GateOn, no release.
        b.actions.append(
            Settle(pod, st.evolve(state=UnitState.FAILED, reason=reason), release=False)
        )
        b.reasons[pod.name] = reason
    what = "rollback of" if rollback else "update of"
    message = f"Failed {what} {_unit_label(unit)}: {reason}"[:1000]
    b.emit(Reason.UNIT_FAILED, message, warning=True, pods=flying)
    b.finished[unit.key] = "failed"
    d = b.duration(unit)
    if d is not None:
        b.durations[unit.key] = d
    b.progressed = True
    return False


_NO_STATE = WeightState(
    state=UnitState.DRAINING, by=OwnerKey("-"), version="-", update_id=UpdateId("-")
)


def _prev(pod: PodView) -> WeightState:
    return pod.state if pod.state is not None else _NO_STATE


def _claim(b: _Builder, unit: Unit, *, rollback_of: str | None = None) -> None:
    owner, now = b.fleet.owner, b.now
    tl = b.spec.strategy.traffic_label
    for pod in unit.pods:
        agent = b.fleet.agents.get(pod.name)
        prior = pod.state if pod.state is not None and pod.state.by == owner else None
        # Counted per pod across WeightUpdates: another's claim overwrote this one's record,
        # so a count restarted at 1 would repeat an id this WeightUpdate already used here.
        attempt = (pod.state.attempt if pod.state is not None else 0) + 1
        if rollback_of is not None:
            assert pod.state is not None and pod.state.previous_version
            st = pod.state.evolve(
                state=UnitState.ROLLING_BACK,
                version=pod.state.previous_version,
                source=pod.state.previous_source,
                update_id=b.fleet.attempt_id(pod.state.previous_version, attempt, rollback=True),
                attempt=attempt,
                started_at=timestamp(now),
                reason="",
                rollback_of=rollback_of,
            )
        else:
            # Another attempt at the same target keeps what the pod served before the first
            # one (the rollback target); otherwise the previous weights are what it serves now.
            again = (
                prior is not None
                and prior.version == b.spec.version
                and prior.rollback_of is None
                and bool(prior.previous_version)
            )
            if again:
                assert prior is not None
                previous, source = prior.previous_version, prior.previous_source
            elif agent is not None:
                previous, source = agent.version, agent.source
            else:
                previous, source = _prev(pod).previous_version, _prev(pod).previous_source
            st = WeightState(
                state=UnitState.DRAINING,
                by=owner,
                version=b.spec.version,
                source=target_source(b.spec),
                update_id=b.fleet.attempt_id(b.spec.version, attempt),
                previous_version=previous,
                previous_source=source,
                started_at=timestamp(now),
                traffic_label_value=pod.labels.get(tl)
                if tl and tl in pod.labels
                else (prior.traffic_label_value if again and prior is not None else None),
                attempt=attempt,
            )
        remove = tl if tl and tl in pod.labels else None
        b.actions.append(Claim(pod, owner, st, remove_label=remove))
        b.actions.append(GateOff(pod, message=f"Draining for weights {st.version}"))
    if rollback_of is not None:
        b.emit(
            Reason.UNIT_ROLLING_BACK,
            f"Draining {_unit_label(unit)} to roll back from {rollback_of}",
            pods=unit.pods,
        )
    else:
        message = f"Draining {_unit_label(unit)} for weights {b.spec.version}"
        b.emit(Reason.UNIT_DRAINING, message, pods=unit.pods)
    b.progressed = True


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
        if cls in _FAILED_CLASSES and p.state is not None:
            reasons[p.name] = p.state.reason
        elif cls is PodClass.BLOCKED:
            blocked.add(str(p.owner))
        if p.stale:
            frozen.add(p.unit)
    return Seen(
        units=units,
        classes=classes,
        by_unit={
            u.key: _ONE_CLASS[classes[u.pods[0].name]]
            if len(u.pods) == 1
            else frozenset(classes[p.name] for p in u.pods)
            for u in units
        },
        blocked_by=tuple(sorted(blocked | set(fleet.peers))),
        max_unavailable=resolve_max_unavailable(spec.strategy.max_unavailable, max(1, len(units))),
        frozen=frozenset(frozen),
        reasons=reasons,
    )


#: A pod a younger WeightUpdate selects after this one finished is no work of this one
#: (``domain.ownership``), unless it already serves this version in traffic.
_YIELDED = frozenset({PodClass.PENDING, PodClass.UNKNOWN, PodClass.UPDATED})
_SERVING = (PodClass.UPDATED, True)
#: The class set of a one-pod unit (most units): built once, not once per unit and pass.
_ONE_CLASS = {c: frozenset((c,)) for c in PodClass}


def advance_units(b: _Builder, seen: Seen) -> frozenset[str]:
    """Step 2: move each in-flight unit one step; return the keys of those still in flight."""
    flying = set()
    for unit in seen.units:
        if PodClass.IN_FLIGHT not in seen.by_unit[unit.key]:
            continue
        if unit.key in seen.frozen or _advance_in_flight(b, unit):
            flying.add(unit.key)
    return frozenset(flying)


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


def deadlines(b: _Builder, seen: Seen, persisted: Persisted, flying: frozenset[str]) -> Halt:
    """Step 3: the pause and canary holds, the failed canary, the failure budget and the
    progress deadline (a new halt is persisted as an abort intent and posted as an Event).

    Time on hold or Blocked, before the operator's start (``clock_floor``) or before a retry
    never counts against ``progressDeadlineSeconds``.
    """
    spec, now, owner, version = b.spec, b.now, b.fleet.owner, b.spec.version
    target = target_source(spec)
    units, by_unit = seen.units, seen.by_unit
    aborted_at, abort_reason = persisted.aborted_at, persisted.abort_reason

    finished = b.finished

    def failed(u: Unit) -> bool:
        return PodClass.FAILED in by_unit[u.key] or finished.get(u.key) == "failed"

    pending = tuple(
        u
        for u in units
        if u.key not in finished
        and u.key not in flying
        and by_unit[u.key] <= _STARTABLE
        and not by_unit[u.key].isdisjoint(_WANTING)
    )
    touched_keys = {
        p.unit
        for p in b.fleet.pods
        if (st := p.state) is not None
        and st.by == owner
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
    settled = all(u.key not in flying and by_unit[u.key].isdisjoint(_WANTING) for u in touched)
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
    verdict = halt_verdict(
        spec.strategy,
        finished=persisted.completion_time is not None,
        canary_failed=canary_failed,
        failed_units=sum(1 for u in units if failed(u)),
        max_unavailable=seen.max_unavailable,
        waiting_for_slot=sum(1 for u in pending if u.ready),
        working=bool(flying or pending) and paused_reason is None and not seen.blocked_by,
        progressed=b.progressed,
        clock=clock,
        now=now,
    )
    if aborted_at is None and verdict is not None:
        aborted_at, abort_reason = timestamp(now), verdict.reason
        b.emit(verdict.reason, verdict.message, warning=True)
    return Halt(
        aborted_at, abort_reason, paused_reason, hold_released, pending, touched, canary_done
    )


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
        if not u.ready
        or u.key in seen.frozen
        or u.key in flying
        or not seen.by_unit[u.key].isdisjoint(_FAILED_CLASSES)
    }
    leaving = {
        key
        for key, until in (terminating or {}).items()
        if key not in down and (now is None or (parse_time(until) or now) >= now)
    }
    return seen.max_unavailable - len(down) - len(leaving)


def _held(seen: Seen, flying: frozenset[str], unit: Unit) -> bool:
    """The rollout keeps ``unit`` out of traffic (``domain.availability``)."""
    return (
        unit.key in flying
        or unit.key in seen.frozen
        or not seen.by_unit[unit.key].isdisjoint(_FAILED_CLASSES)
        or any(p.has_gate and p.gate is not True for p in unit.pods)
    )


def roll_back(b: _Builder, seen: Seen, flying: frozenset[str], slots: Slots) -> int:
    """Step 5a (halted with ``onFailure: Rollback``): roll back every touched, settled unit in
    place, within the budget; return how many units are still to roll back."""
    owner, version = b.fleet.owner, b.spec.version
    remaining = 0
    for unit in seen.units:
        if unit.key in b.finished:
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
                b.actions.append(
                    Settle(
                        p,
                        p.state.evolve(state=UnitState.FAILED, reason=why, rollback_of=version),
                        release=False,
                    )
                )
                b.reasons[p.name] = why
            message = f"Cannot roll back {_unit_label(unit)}: {why}"
            b.emit(Reason.UNIT_FAILED, message, True, pods=needs)
            continue
        if not slots.affords(unit):
            continue
        if not b.take_steps(len(unit.pods)):
            continue
        slots.take(unit)
        _claim(b, unit, rollback_of=version)
    return remaining


def start_units(b: _Builder, seen: Seen, flying: frozenset[str], halt: Halt, slots: Slots) -> None:
    """Step 5b: start new units, those held out of traffic by our gate first (free), then
    while slots remain (what each claim costs: ``domain.availability``).

    The canary goes first; units never touched wait until every canary unit has a verdict
    that stands (``Halt.canary_done``), while touched units that want the version again (a
    retried canary among them) may start within the budget. Only units whose pending pods may
    be claimed (:func:`_can_claim`) start.
    """
    fleet, owner, version = b.fleet, b.fleet.owner, b.spec.version
    canary = b.spec.strategy.canary
    touched = {u.key for u in halt.touched}
    limit = None  # how many units never touched may start
    if canary is not None and not halt.canary_done:
        limit = max(0, canary - len(touched))

    def startable(u: Unit) -> bool:
        return (
            u.key not in seen.frozen
            and all(seen.classes[p.name] in (PodClass.PENDING, PodClass.UPDATED) for p in u.pods)
            and all(
                _can_claim(p, fleet.agents.get(p.name), owner, version)
                for p in u.pods
                if seen.classes[p.name] is PodClass.PENDING
            )
        )

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
        if not startable(unit):
            continue
        if not b.take_steps(len(unit.pods)):
            break
        if fresh and limit is not None:
            limit -= 1
        slots.take(unit)
        # A claim records what the pod serves (the rollback target) and that it runs no
        # update: only an answer from this pass may say so, never a cached one (a trainer push
        # changes both without touching the pod). The caller asks afresh, then applies this
        # plan only if the fresh answers are the cached ones (``provisional``), else plans
        # again.
        stale = [p.name for p in unit.pods if p.name in fleet.cached]
        if stale:
            b.refresh.update(stale)
            if not b.provisional:
                continue
        _claim(b, unit)


def _rollback_target(b: _Builder) -> tuple[str, SourceRef] | None:
    """What a rollback returns the fleet to: the previous version and files every unit this
    WeightUpdate touched for its version recorded, when they agree (else ``None``)."""
    owner, version = b.fleet.owner, b.spec.version
    targets = {
        (st.previous_version, st.previous_source)
        for p in b.fleet.pods
        if (st := p.state) is not None
        and st.by == owner
        and (st.version == version or st.rollback_of == version)
    }
    if len(targets) != 1:
        return None
    ((previous, source),) = targets
    return (previous, source) if previous and source is not None else None


def restore(b: _Builder, seen: Seen, back_to: tuple[str, SourceRef] | None = None) -> None:
    """Step 6: settled pods at the target whose traffic is off (new pods, or a restart between
    the GateOn and the Settle) get their gate back; only an agent ready at the target version
    vouches for it, and for a pod this WeightUpdate verified only its recorded attempt's live
    commit (or ranks that booted at the version: a cold engine on it is the oracle itself).

    During a rollback (``back_to``: :func:`_rollback_target`) the target is what the fleet
    returns to: a pod this WeightUpdate never touched that serves it (a new pod) gets its gate
    too. Left drained, it held the whole budget, the rollback took no slot, and the halted
    WeightUpdate stayed ``RollingBack`` for ever, blocking every younger one over its pods
    (found by the simulation tier)."""
    owner, version = b.fleet.owner, b.spec.version
    if back_to is not None:
        _restore_untouched(b, seen, *back_to)
    for pod in b.fleet.pods:
        if seen.classes[pod.name] is not PodClass.UPDATED or pod.gate is True or pod.stale:
            continue
        agent = b.fleet.agents.get(pod.name)
        if agent is None or not (agent.reachable and agent.ready and agent.version == version):
            continue
        st = pod.state
        ours = st is not None and st.by == owner and st.state is UnitState.VERIFIED
        if ours and st is not None and agent.committed_update_id not in (None, st.update_id):
            continue
        if not b.take_steps(1):
            return
        b.actions.append(GateOn(pod, version=version, reason="ServingTarget"))
        message = f"Restored traffic to {pod.name}, ready at {version}"
        b.emit(Reason.UNIT_RESTORED, message, pods=(pod,))


def _restore_untouched(b: _Builder, seen: Seen, version: str, source: SourceRef) -> None:
    owner = b.fleet.owner
    for pod in b.fleet.pods:
        st = pod.state
        if seen.classes[pod.name] is not PodClass.PENDING or pod.gate is True or pod.stale:
            continue
        if st is not None and st.by == owner:
            continue  # touched: the rollback itself decides it
        if not _serves(b.fleet.agents.get(pod.name), version, source) or not b.take_steps(1):
            continue
        b.actions.append(GateOn(pod, version=version, reason="ServingRollbackTarget"))
        message = f"Restored traffic to {pod.name}, ready at {version} (the rollback's target)"
        b.emit(Reason.UNIT_RESTORED, message, pods=(pod,))


def withdraw(b: _Builder) -> None:
    """Step 7: a verdict of this WeightUpdate that a ready agent contradicts is withdrawn at
    once (``domain.standing``), unless this pass drains the pod already (its claim rewrites the
    record). Judged on a fresh answer only, as a claim is (:attr:`Plan.refresh`)."""
    owner = b.fleet.owner
    acted = {a.pod.name for a in b.actions if not isinstance(a, Emit)}
    for pod in b.fleet.pods:
        st = pod.state
        if pod.name in acted or pod.stale or st is None:
            continue
        agent = b.fleet.agents.get(pod.name)
        why = withdrawal(st, agent, owner)
        if why is None or agent is None or agent.version is None:
            continue
        if pod.name in b.fleet.cached:
            b.refresh.add(pod.name)
            if not b.provisional:
                continue
        labels: dict[str, str | None] = {LABEL_WEIGHT_VERSION: agent.version}
        b.actions.append(
            Settle(pod, st.evolve(state=UnitState.WITHDRAWN, reason=why), labels=labels)
        )
        if pod.gate is True:
            message = f"Serving {agent.version}: {why} (its verdict at {st.version} withdrawn)"
            b.actions.append(
                GateOn(pod, version=agent.version, reason="Reattested", message=message[:1000])
            )
        b.emit(
            Reason.UNIT_WITHDRAWN,
            f"Withdrew the verdict of {pod.name} at {st.version}: {why}",
            pods=(pod,),
        )


class _Notes(Mapping[str, str]):
    """Why a pod is not being worked on, or is worked on again, by pod name (:func:`_note`).

    Worked out per pod when asked: the status names at most ``MAX_POD_RESULTS`` pods, and at
    10,000 pending pods working out every note cost a tenth of a pass.
    """

    __slots__ = ("_classes", "_fleet", "_pods", "_source", "_version")

    def __init__(
        self,
        fleet: Fleet,
        version: str,
        source: SourceRef,
        classes: Mapping[str, PodClass],
        pods: Mapping[str, PodView],
    ) -> None:
        self._fleet, self._version, self._source = fleet, version, source
        self._classes, self._pods = classes, pods

    def __getitem__(self, name: str) -> str:
        cls = self._classes.get(name)
        note = None
        if cls in _NOTED:
            assert cls is not None
            fleet = self._fleet
            agent, pod = fleet.agents.get(name), self._pods[name]
            note = _note(cls, pod, agent, fleet.owner, self._version, self._source)
        if note is None:
            raise KeyError(name)
        return note

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._classes if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        try:
            self[str(name)]
        except KeyError:
            return False
        return True


def _note(
    cls: PodClass,
    pod: PodView,
    agent: AgentView | None,
    owner: OwnerKey,
    version: str,
    source: SourceRef,
) -> str | None:
    """Why ``pod`` (of class ``cls``) is not being worked on, or is worked on again."""
    st, note = pod.state, None
    if cls is PodClass.UNKNOWN:
        note = f"AgentUnreachable: {agent.error}" if agent else "AgentUnreachable"
    elif cls is PodClass.PENDING and not _can_claim(pod, agent, owner, version):
        note = "Joining: waiting for its agent to answer at a known version"
    if (
        cls in (PodClass.PENDING, PodClass.IN_FLIGHT)
        and st is not None
        and st.state is UnitState.VERIFIED
        and st.version == version
        and agent is not None
        and agent.reachable
        and not _serves(agent, version, source)
    ):
        if agent.version != version:
            why = f"its agent now serves {agent.version or 'an unknown version'}"
        elif not agent.ready:
            why = "its agent is not ready (held, paused or poisoned)"
        else:
            served, wanted = _spelled(agent.source), _spelled(source)
            why = f"it serves {version} from {served}, not from spec.source {wanted}"
        note = (
            f"NotServing: verified at {version} by {st.update_id}, but {why}; updated "
            "again by a new attempt"
        )
    return note


def settle(
    b: _Builder,
    seen: Seen,
    persisted: Persisted,
    flying: frozenset[str],
    halt: Halt,
    rollback: bool,
    rollback_remaining: int,
) -> Plan:
    """Step 8: reflect this pass's own transitions in the classes and persist what must be."""
    now, version, fleet, target = b.now, b.spec.version, b.fleet, target_source(b.spec)
    classes = dict(seen.classes)
    restored = {a.pod.name for a in b.actions if isinstance(a, GateOn)}
    for action in b.actions:
        if isinstance(action, Claim):
            classes[action.pod.name] = PodClass.IN_FLIGHT
        elif isinstance(action, Settle):
            done = {
                # a verdict for other files or an earlier version (the spec changed after the
                # agent accepted the update) is no verdict for this spec: wanted again
                UnitState.VERIFIED: PodClass.UPDATED
                if _verified_at(action.state, version, target)
                else PodClass.PENDING,
                UnitState.ROLLED_BACK: PodClass.ROLLED_BACK,
                UnitState.FAILED: PodClass.ROLLBACK_FAILED
                if action.state.rollback_of
                else PodClass.FAILED,
            }
            if action.state.state in done:
                classes[action.pod.name] = done[action.state.state]
    claimed_units = {a.pod.unit for a in b.actions if isinstance(a, Claim)}
    all_done = (
        bool(seen.units)
        and halt.aborted_at is None
        # failed units within maxFailedReplicas are tolerated (``halts``): reported, not waited
        # for; a fleet of failures alone is no completion
        and all(c in _DONE for c in classes.values())
        and PodClass.UPDATED in classes.values()
        and all(
            p.gate is True or p.name in restored
            for p in fleet.pods
            if classes[p.name] is PodClass.UPDATED
        )
    )
    new_persisted = Persisted(
        target_version=version,
        start_time=persisted.start_time or (timestamp(now) if claimed_units else None),
        completion_time=persisted.completion_time or (timestamp(now) if all_done else None),
        last_progress_time=timestamp(now)
        if b.progressed or halt.hold_released
        else persisted.last_progress_time,
        aborted_at=halt.aborted_at,
        abort_reason=halt.abort_reason,
        retried_at=persisted.retried_at,
    )
    pods = {p.name: p for p in fleet.pods}
    return Plan(
        actions=aggregate_events(b.actions),
        persisted=new_persisted,
        classes=classes,
        pods=pods,
        reasons={**seen.reasons, **b.reasons},
        notes=_Notes(fleet, version, target, classes, pods),
        units_total=len(seen.units),
        max_unavailable=seen.max_unavailable,
        paused_reason=halt.paused_reason,
        blocked_by=seen.blocked_by,
        finished=b.finished,
        durations=b.durations,
        in_flight_units=len(flying | claimed_units),
        pending_units=sum(1 for u in halt.pending if u.key not in claimed_units),
        completed=new_persisted.completion_time is not None,
        rolling_back=rollback,
        rollback_remaining=rollback_remaining,
        refresh=frozenset(b.refresh),
        deferred=b.deferred,
    )


def unsettled(the_plan: Plan, failed: Iterable[str], before: Persisted) -> Plan:
    """The plan once some of its pod writes failed (``failed``: pod names whose ``GateOn``, or
    ``Settle`` as verified, did not happen, e.g. a 409 because kubelet wrote the pod meanwhile).

    :func:`settle` counts this pass's GateOns and Settles as done; when one of them failed,
    a completion reached only through it is none: the rollout is not ``Succeeded`` with a pod
    out of traffic, and no completion time is persisted. A pod whose verified Settle failed is
    still in flight, not updated. The next pass reads the pods again and settles for real.
    (A unit the plan failed stays failed: that verdict is the operator's, whether or not it
    could be written yet.) A unit with such a pod did not finish this pass either: it leaves
    ``finished`` and ``durations`` (the unit-duration histogram), since the next pass plans its
    end again and reports it then, once.
    """
    names = frozenset(name for name in failed if name in the_plan.pods)
    if not names:
        return the_plan
    units = {the_plan.pods[name].unit for name in names}
    classes = dict(the_plan.classes)
    for name in names:
        pod = the_plan.pods.get(name)
        in_flight = pod is not None and pod.state is not None and pod.state.state.in_flight
        if in_flight and classes.get(name) is PodClass.UPDATED:
            classes[name] = PodClass.IN_FLIGHT  # its Settle did not happen
    newly = the_plan.persisted.completion_time is not None and before.completion_time is None
    persisted = replace(the_plan.persisted, completion_time=None) if newly else the_plan.persisted
    return replace(
        the_plan,
        classes=classes,
        persisted=persisted,
        completed=persisted.completion_time is not None,
        finished={k: v for k, v in the_plan.finished.items() if k not in units},
        durations={k: v for k, v in the_plan.durations.items() if k not in units},
    )


def plan(
    spec: WeightUpdateSpec,
    fleet: Fleet,
    persisted: Persisted,
    now: datetime,
    *,
    step_limit: int | None = None,
    provisional: bool = False,
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
            10,000 pods one batch is 1,000 units. ``None``: no limit.
        provisional: claim pods on cached agent answers too (each listed in
            :attr:`Plan.refresh`). Such a plan is the plan of fresh answers only if the caller
            asked those agents again and got the very answers it was made on (``fleet.cached``
            matters nowhere else); otherwise the caller must plan again. Saves planning twice
            at 10,000 pods, where a claim pass otherwise always does.

    Returns:
        The plan; its actions must be applied in order per pod.
    """
    b = _Builder(spec, fleet, now)
    b.clock_floor = parse_time(persisted.clock_floor)
    if step_limit is not None:
        b.steps_left = b.step_limit = max(1, step_limit)
    b.provisional = provisional
    seen = classify_fleet(spec, fleet, persisted)
    flying = advance_units(b, seen)
    halt = deadlines(b, seen, persisted, flying)
    slots = Slots.of(
        seen.max_unavailable,
        budget(seen, flying, fleet.terminating, now),
        (u for u in seen.units if _held(seen, flying, u)),
        # a NotReady unit its agents keep out until an update is as free as one our gate holds
        (u.key for u in seen.units if not u.ready and held_by_agent(u, fleet.agents)),
    )
    rollback = halt.aborted_at is not None and spec.strategy.on_failure is OnFailure.ROLLBACK
    remaining = 0
    if rollback:
        remaining = roll_back(b, seen, flying, slots)
    elif halt.aborted_at is None and halt.paused_reason is None and not seen.blocked_by:
        start_units(b, seen, flying, halt, slots)
    restore(b, seen, _rollback_target(b) if rollback else None)
    withdraw(b)
    return settle(b, seen, persisted, flying, halt, rollback, remaining)
