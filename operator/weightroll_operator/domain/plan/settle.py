"""Step 8, :func:`settle`: this pass's own transitions in the classes, what must be persisted,
and the :class:`~.context.Plan`; :func:`unsettled` takes back what failed writes did not do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

from engine_agent.protocol import UpdatePhase
from weightroll_operator.domain.actions import Claim, GateOn, Settle
from weightroll_operator.domain.conditions import timestamp
from weightroll_operator.domain.events import aggregate_events
from weightroll_operator.domain.model import AgentView, OwnerKey, PodView, SourceRef, UnitState
from weightroll_operator.domain.plan.claim import can_claim
from weightroll_operator.domain.plan.classify import Seen, serves, spelled, verified_at
from weightroll_operator.domain.plan.context import (
    WANTING_CLASSES,
    PassContext,
    Persisted,
    Plan,
    PodClass,
    target_source,
)
from weightroll_operator.domain.plan.deadlines import Halt
from weightroll_operator.domain.standing import outlived

#: The classes of a completed rollout: failed within the tolerance (else it halted) or done.
_DONE = frozenset({PodClass.UPDATED, PodClass.FOREIGN, PodClass.FAILED})
#: The classes :func:`_note` may say something about.
_NOTED = frozenset({PodClass.UNKNOWN, PodClass.PENDING, PodClass.IN_FLIGHT})


class _ByPod(Mapping[str, str]):
    """A per-pod string worked out when asked (``of(name, class)``, ``None``: nothing to say),
    for the pods of ``classes``: the status names at most ``MAX_POD_RESULTS`` pods, and at
    10,000 pods working out every one cost a tenth of a pass (at 100,000, a walk over the fleet
    each pass for nothing). The plan's ``notes`` (:func:`_note`) and ``steps``
    (:func:`pod_step`)."""

    __slots__ = ("_classes", "_of")

    def over(self, classes: Mapping[str, PodClass]) -> _ByPod:
        """The same strings, worked out for the pods of ``classes`` instead."""
        return _ByPod(classes, self._of)

    def __init__(
        self, classes: Mapping[str, PodClass], of: Callable[[str, PodClass], str | None]
    ) -> None:
        self._classes, self._of = classes, of

    def __getitem__(self, name: str) -> str:
        cls = self._classes.get(name)
        value = None if cls is None else self._of(name, cls)
        if value is None:
            raise KeyError(name)
        return value

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
        gone = outlived(st, pod, agent, owner)
        if gone is not None and st is not None:
            note += f"; its verdict at {st.version} vouches for nothing seen: {gone.why}"
    elif cls is PodClass.PENDING and not can_claim(pod, agent, owner, version):
        note = "Joining: waiting for its agent to answer at a known version"
    if (
        cls in (PodClass.PENDING, PodClass.IN_FLIGHT)
        and st is not None
        and st.state is UnitState.VERIFIED
        and st.version == version
        and agent is not None
        and agent.reachable
        and not serves(agent, version, source)
    ):
        if agent.version != version:
            why = f"its agent now serves {agent.version or 'an unknown version'}"
        elif not agent.ready:
            why = "its agent is not ready (held, paused or poisoned)"
        else:
            served, wanted = spelled(agent.source), spelled(source)
            why = f"it serves {version} from {served}, not from spec.source {wanted}"
        note = (
            f"NotServing: verified at {version} by {st.update_id}, but {why}; updated "
            "again by a new attempt"
        )
    return note


#: Agent phases of an update in the drain, before its verification.
_SWAPPING = frozenset({UpdatePhase.DRAINING, UpdatePhase.LOADING})


def pod_step(
    cls: PodClass, pod: PodView, agent: AgentView | None, restored: frozenset[str] | set[str]
) -> str | None:
    """Where a pod being worked on stands: ``Prefetching`` -> ``Prefetched`` (reading ahead of
    its drain, serving) -> ``Draining`` (gate off, waiting for the drain or the swap) ->
    ``Swapping`` (paused: the new weights written) -> ``Verifying`` (all-rank agreement, the
    commit, the resume) -> ``Ready`` (verified, traffic back). ``None`` for other pods."""
    update = agent.update if agent is not None else None
    if cls is PodClass.PREFETCHING:
        prefetched = update is not None and update.phase is UpdatePhase.PREFETCHED
        return "Prefetched" if prefetched else "Prefetching"
    if cls is PodClass.IN_FLIGHT:
        if update is None:
            return "Draining"
        if update.phase in _SWAPPING:
            return "Swapping"
        if update.phase in (UpdatePhase.VERIFYING, UpdatePhase.COMMITTED):
            return "Verifying"
        return "Draining"
    worked = pod.state is not None and pod.state.state in (UnitState.VERIFIED, UnitState.DRAINING)
    if cls is PodClass.UPDATED and worked and (pod.gate is True or pod.name in restored):
        return "Ready"  # taken there by an attempt (not a pod that already served it)
    return None


def settle(
    ctx: PassContext,
    seen: Seen,
    persisted: Persisted,
    flying: frozenset[str],
    halt: Halt,
    rollback: bool,
    rollback_remaining: int,
) -> Plan:
    """Step 8: reflect this pass's own transitions in the classes and persist what must be."""
    now, version, fleet, target = ctx.now, ctx.spec.version, ctx.fleet, target_source(ctx.spec)
    classes = dict(seen.classes)
    restored = {a.pod.name for a in ctx.actions if isinstance(a, GateOn)}
    claimed_from: dict[str, PodClass] = {}
    for action in ctx.actions:
        if isinstance(action, Claim):
            claimed_from.setdefault(action.pod.name, classes[action.pod.name])
            staged = action.state.state is UnitState.PREFETCHING
            classes[action.pod.name] = PodClass.PREFETCHING if staged else PodClass.IN_FLIGHT
        elif isinstance(action, Settle) and action.transition:
            done = {
                # a verdict for other files or an earlier version (the spec changed after the
                # agent accepted the update) is no verdict for this spec: wanted again
                UnitState.VERIFIED: PodClass.UPDATED
                if verified_at(action.state, version, target)
                else PodClass.PENDING,
                UnitState.ROLLED_BACK: PodClass.ROLLED_BACK,
                UnitState.FAILED: PodClass.ROLLBACK_FAILED
                if action.state.rollback_of
                else PodClass.FAILED,
            }
            if action.state.state in done:
                classes[action.pod.name] = done[action.state.state]
            elif classes[action.pod.name] in (PodClass.IN_FLIGHT, PodClass.PREFETCHING):
                # a claim released (``advance``), or a staging released: wanted again
                classes[action.pod.name] = PodClass.PENDING
    claims = [a for a in ctx.actions if isinstance(a, Claim)]
    claimed_units = {a.pod.unit for a in claims}
    # a unit staged for its prefetch this pass is not in flight (it serves), and not pending
    drained_units = {a.pod.unit for a in claims if a.state.state is not UnitState.PREFETCHING}
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
        if ctx.progressed or halt.hold_released
        else persisted.last_progress_time,
        aborted_at=halt.aborted_at,
        abort_reason=halt.abort_reason,
        retried_at=persisted.retried_at,
    )
    pods = {p.name: p for p in fleet.pods}
    return Plan(
        actions=aggregate_events(ctx.actions),
        persisted=new_persisted,
        classes=classes,
        pods=pods,
        reasons={**seen.reasons, **ctx.reasons},
        notes=_ByPod(
            classes,
            lambda name, cls: (
                _note(cls, pods[name], fleet.agents.get(name), fleet.owner, version, target)
                if cls in _NOTED
                else None
            ),
        ),
        units_total=len(seen.units),
        max_unavailable=seen.max_unavailable,
        paused_reason=halt.paused_reason,
        blocked_by=seen.blocked_by,
        finished=ctx.finished,
        durations=ctx.durations,
        in_flight_units=len(flying | drained_units),
        pending_units=sum(1 for u in halt.pending if u.key not in claimed_units),
        completed=new_persisted.completion_time is not None,
        rolling_back=rollback,
        rollback_remaining=rollback_remaining,
        premises=tuple(ctx.premises),
        claimed_from=claimed_from,
        deferred=ctx.deferred,
        steps=_ByPod(
            classes,
            lambda name, cls: pod_step(cls, pods[name], fleet.agents.get(name), restored),
        ),
    )


def unsettled(
    the_plan: Plan, failed: Iterable[str], before: Persisted, unclaimed: Iterable[str] = ()
) -> Plan:
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

    ``unclaimed``: pods whose ``Claim`` did not happen (it failed, or the caller dropped it, its
    premise no longer holding: ``reconcile/confirm.py``). They are what they were before it
    (:attr:`Plan.claimed_from`): not in flight, and no start time is persisted for a rollout
    whose every claim of this pass did not happen.
    """
    names = frozenset(name for name in failed if name in the_plan.pods)
    back = {n: the_plan.claimed_from[n] for n in unclaimed if n in the_plan.claimed_from}
    if not names and not back:
        return the_plan
    if back:
        the_plan = _unclaimed(the_plan, back, before)
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


def _unclaimed(the_plan: Plan, back: Mapping[str, PodClass], before: Persisted) -> Plan:
    """:func:`unsettled` for the pods of ``back`` whose claims did not happen: each has the
    class it had before its claim."""
    classes = {**the_plan.classes, **back}
    # a unit is out of flight (or pending again) only when none of its claims happened: a claim
    # that failed on one pod of a group leaves the others draining
    kept = {the_plan.pods[n].unit for n in the_plan.claimed_from if n not in back}
    units = {n: the_plan.pods[n].unit for n in back if the_plan.pods[n].unit not in kept}
    drained = {
        u
        for n, u in units.items()
        if the_plan.classes.get(n) is PodClass.IN_FLIGHT and back[n] is not PodClass.IN_FLIGHT
    }
    pending = {u for n, u in units.items() if back[n] in WANTING_CLASSES}
    persisted = the_plan.persisted
    if before.start_time is None and back.keys() >= the_plan.claimed_from.keys():
        persisted = replace(persisted, start_time=None)
    notes, steps = the_plan.notes, the_plan.steps
    return replace(
        the_plan,
        classes=classes,
        persisted=persisted,
        in_flight_units=max(0, the_plan.in_flight_units - len(drained)),
        pending_units=the_plan.pending_units + len(pending),
        notes=notes.over(classes) if isinstance(notes, _ByPod) else notes,
        steps=steps.over(classes) if isinstance(steps, _ByPod) else steps,
    )
