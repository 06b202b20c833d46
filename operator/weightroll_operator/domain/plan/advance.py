"""Step 2, :func:`advance_units`: move each in-flight unit one step.

Drained -> update started -> every agent serves the attempt -> traffic back and verified; or
failed (stays drained), timed out (the agent's answer to our abort is the verdict), or
retargeted at the spec's version when the spec moved on while the unit was out of traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from engine_agent.protocol import UpdatePhase
from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.domain.actions import (
    AbortUpdate,
    Claim,
    GateOff,
    GateOn,
    Settle,
    StartUpdate,
    SwapUpdate,
)
from weightroll_operator.domain.availability import Slots
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.gate_vouch import GateVouch
from weightroll_operator.domain.model import (
    LABEL_WEIGHT_VERSION,
    AgentView,
    PodView,
    UnitState,
    WeightState,
)
from weightroll_operator.domain.plan.claim import idle
from weightroll_operator.domain.plan.classify import Seen
from weightroll_operator.domain.plan.context import (
    PassContext,
    parse_time,
    target_source,
    unit_label,
)
from weightroll_operator.domain.unit_timeout import ABORT_GRACE_SECONDS, aborted_reason, on_timeout
from weightroll_operator.domain.wire import build_request


def advance_units(ctx: PassContext, seen: Seen) -> frozenset[str]:
    """Step 2: move each in-flight unit one step; return the keys of those still in flight."""
    flying = set()
    for unit in seen.in_flight:
        if unit.key in seen.frozen or _advance_in_flight(ctx, unit):
            flying.add(unit.key)
    return frozenset(flying)


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


def _advance_in_flight(ctx: PassContext, unit: Unit) -> bool:
    """Move one in-flight unit one step; return True while it stays in flight."""
    spec, now, owner = ctx.spec, ctx.now, ctx.fleet.owner
    flying = [
        p for p in unit.pods if p.state is not None and p.owner == owner and p.state.state.in_flight
    ]
    rollback = any(p.state is not None and p.state.state is UnitState.ROLLING_BACK for p in flying)
    label = unit_label(unit)
    agents = ctx.fleet.agents
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
    if not all_committed and _drain_never_landed(flying, agents):
        # A claim whose drain never landed (the operator stopped between the two writes) is
        # a claim waiting for its slot: drained by ``plan`` only within the budget of now
        # (a budget lowered meanwhile once drained it beside the unit that held the slot).
        ctx.undrained.append(unit)
        return True
    for pod in flying:
        if pod.gate is not False and not all_committed:
            ctx.actions.append(GateOff(pod, message=f"Draining for weights {pod.state.version}"))  # type: ignore[union-attr]
    drained = all_committed or all(
        p.gate is False and (not p.ready or not p.has_gate) for p in flying
    )
    timeout = timedelta(seconds=spec.strategy.update_timeout_seconds)
    started = [parse_time(p.state.started_at) for p in flying if p.state is not None]
    claimed_at = min((s for s in started if s is not None), default=now)
    # Time the operator was down (or not the leader) is not the unit's: its timers start no
    # earlier than this process began to act (``Persisted.clock_floor``).
    floor = ctx.clock_floor
    if floor is not None and floor > claimed_at:
        claimed_at = floor
    if not drained:
        if now >= claimed_at + timeout:
            return fail_unit(ctx, unit, flying, "DrainTimeout: the pods were not observed NotReady")
        return True

    def timed_out(pod: PodView, grace: float = 0.0) -> bool:
        # The update timer starts when the agent accepted the update (its record's startedAt);
        # before that (not accepted yet), at the claim.
        _, update = ctx.answer(pod)
        accepted = parse_time(update.started_at) if update is not None else None
        if accepted is not None and floor is not None and floor > accepted:
            accepted = floor
        # A unit claimed after its prefetch (accepted before the claim): its timer starts at
        # the drain, as any unit's; the prefetch had its own bound.
        if accepted is not None and accepted < claimed_at:
            accepted = claimed_at
        return now >= (accepted or claimed_at) + timeout + timedelta(seconds=grace)

    running: list[PodView] = []
    #: Pods given a fresh attempt this pass: their timer is the new attempt's (it starts now),
    #: never the superseded one's.
    retargeted: list[PodView] = []
    failed: dict[str, str] = {}
    for pod in flying:
        st = pod.state
        assert st is not None
        agent, update = ctx.answer(pod)
        if agent is None or not agent.reachable:
            running.append(pod)
        elif committed[pod.name]:
            continue
        elif update is None and not rollback and idle(agent) and outdated(spec, st):
            # spec.version (or with it the source) changed before this pod's update started:
            # retarget it instead of sending the old version with the new source, or recording
            # the old source for the new files.
            _retarget(ctx, pod, st)
            retargeted.append(pod)
        elif update is None:
            if agent.active_update_id != st.update_id and ctx.take_steps(1):
                ctx.actions.append(StartUpdate(pod, build_request(spec, st, rollback=rollback)))
            running.append(pod)
        elif update.phase is UpdatePhase.PREFETCHED:
            # observed drained (above): the go for the update parked with its prefetch verified
            ctx.actions.append(SwapUpdate(pod, st.update_id))
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
                update_id=ctx.fleet.attempt_id(st.version, st.attempt + 1, rollback=rollback),
                attempt=st.attempt + 1,
                reason=f"NotServingCommit: ranks serve {agent.version or 'an unknown version'}",
            )
            ctx.actions.append(Claim(pod, owner, again))
            ctx.progressed = True
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
                ctx.actions.append(AbortUpdate(pod, pod.state.update_id))
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
        and all(p.state is not None and outdated(spec, p.state) for p in flying)
    ):
        # The attempt failed at a version the spec no longer names (spec.version changed, or
        # was reverted, while it ran): no verdict on this spec, so neither a failed unit nor
        # a failure against maxFailedReplicas (it halted a reverted rollout that every pod
        # served, found by the simulation tier). As a committed outdated attempt is, the unit
        # is retargeted: a fresh attempt at the spec's version, still drained. A new attempt
        # is not recorded over one an agent says it still runs: this pass aborts it and the
        # retarget waits for the agent to say it ended (an operator stopped between the two
        # left a record naming one attempt on an agent running another; simulation tier). An
        # agent that does not answer says nothing of the kind: the retarget waits for it too.
        still_running = [
            p
            for p in aborts_after
            if p.state is not None
            and (
                (answer := agents.get(p.name)) is None
                or not answer.reachable
                or answer.active_update_id == p.state.update_id
                or (
                    answer.update is not None
                    and answer.update.id == p.state.update_id
                    and not answer.update.phase.terminal
                )
            )
        ]
        if not still_running:
            _retarget_unit(ctx, flying)
        ctx.actions.extend(AbortUpdate(p, p.state.update_id) for p in aborts_after if p.state)
        return True
    if failed:
        reason = "; ".join(
            why if len(flying) == 1 else f"{name}: {why}" for name, why in sorted(failed.items())
        )
        fail_unit(ctx, unit, flying, reason)
        # after the Settle: a failed abort call must not hold the recorded verdict back
        ctx.actions.extend(AbortUpdate(p, p.state.update_id) for p in aborts_after if p.state)
        return False
    if not rollback and any(p.state is not None and outdated(spec, p.state) for p in flying):
        # Committed a version the spec no longer wants (spec.version reverted mid-load, issue
        # 27 item 8): never restored at it; a fresh attempt at the spec's version, drained.
        _retarget_unit(ctx, flying)
        return True
    if not ctx.take_steps(len(flying)):
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
            ctx.actions.append(GateOn(pod, version=st.version))
        ctx.actions.append(
            Settle(
                pod,
                # the verdict vouches for these containers only (``domain.standing``)
                st.evolve(
                    state=done,
                    reason="",
                    incarnation=pod.incarnation or None,
                    gate=GateVouch(st.version, st.update_id, pod.incarnation or None),
                ),
                labels=labels,
            )
        )
    version = flying[0].state.version if flying[0].state else "?"
    if rollback:
        ctx.emit(Reason.UNIT_ROLLED_BACK, f"Rolled back {label} to {version}", pods=flying)
        ctx.finish(unit, "rolled_back")
    else:
        ctx.emit(
            Reason.UNIT_VERIFIED,
            f"Verified {label} at {version} and restored traffic",
            pods=flying,
        )
        ctx.finish(unit, "succeeded")
    return False


def _drain_never_landed(flying: list[PodView], agents: Mapping[str, AgentView]) -> bool:
    """Every pod of the unit is claimed, still in traffic by our gate, and its agent knows
    nothing of the attempt: nothing of the claim but its record happened."""
    for pod in flying:
        agent, st = agents.get(pod.name), pod.state
        if pod.gate is not True or st is None or st.state is not UnitState.DRAINING:
            return False
        if agent is None or not agent.reachable or agent.update is not None:
            return False
        if agent.active_update_id == st.update_id:
            return False
    return True


def drain_waiting_claims(ctx: PassContext, slots: Slots, halted: bool) -> None:
    """Drain the claims whose drain never landed (:func:`_advance_in_flight`) as the slots
    allow, before any new claim; the others keep waiting, in traffic. Under a halt nothing
    starts, and such a claim started nothing: it is released (the pod wanted again, its
    record ``Withdrawn`` with the attempt count kept), else it waited for ever."""
    tl = ctx.spec.strategy.traffic_label
    for unit in ctx.undrained if halted else ():
        for pod in unit.pods:
            st = pod.state
            assert st is not None
            labels: dict[str, str | None] = {}
            if tl and st.traffic_label_value is not None:
                labels[tl] = st.traffic_label_value
            why = "ClaimReleased: the rollout halted before its drain"
            ctx.actions.append(
                Settle(pod, st.evolve(state=UnitState.WITHDRAWN, reason=why), labels=labels)
            )
    for unit in () if halted else ctx.undrained:
        if not slots.affords(unit):
            continue
        slots.take(unit)
        for pod in unit.pods:
            version = pod.state.version if pod.state is not None else "?"
            ctx.actions.append(GateOff(pod, message=f"Draining for weights {version}"))


def outdated(spec: WeightUpdateSpec, st: WeightState) -> bool:
    """The attempt ``st`` loads what the spec no longer wants (another version, other files):
    a unit's target is the spec's until the unit is back in traffic."""
    return st.version != spec.version or not target_source(spec).same_files(st.source)


def _retarget(ctx: PassContext, pod: PodView, st: WeightState) -> None:
    """A fresh attempt at the spec's version for an in-flight pod, keeping the previous weights
    it recorded (what a rollback returns to)."""
    spec = ctx.spec
    retarget = st.evolve(
        version=spec.version,
        source=target_source(spec),
        update_id=ctx.fleet.attempt_id(spec.version, st.attempt + 1),
        attempt=st.attempt + 1,
        started_at=timestamp(ctx.now),
    )
    ctx.actions.append(Claim(pod, ctx.fleet.owner, retarget))
    ctx.progressed = True


def _retarget_unit(ctx: PassContext, flying: list[PodView]) -> None:
    """Retarget every in-flight pod of a unit (:func:`_retarget`), drained first."""
    for pod in flying:
        assert pod.state is not None
        if pod.gate is not False:
            ctx.actions.append(GateOff(pod, message=f"Draining for weights {ctx.spec.version}"))
        _retarget(ctx, pod, pod.state)


def fail_unit(ctx: PassContext, unit: Unit, flying: list[PodView], reason: str) -> bool:
    """``unit`` failed (``reason``): every pod of ``flying`` settles ``Failed`` and stays owned
    and as it is (drained; a unit whose prefetch failed, in traffic)."""
    rollback = any(p.state is not None and p.state.state is UnitState.ROLLING_BACK for p in flying)
    for pod in flying:
        st = pod.state
        assert st is not None
        # Failed units stay drained and owned: no GateOn, no release.
        ctx.actions.append(
            Settle(pod, st.evolve(state=UnitState.FAILED, reason=reason), release=False)
        )
        ctx.reasons[pod.name] = reason
    what = "rollback of" if rollback else "update of"
    message = f"Failed {what} {unit_label(unit)}: {reason}"[:1000]
    ctx.emit(Reason.UNIT_FAILED, message, warning=True, pods=flying)
    ctx.finish(unit, "failed")
    return False
