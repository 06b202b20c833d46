"""Claims, shared by :func:`~.start.start_units`, :func:`~.rollback.roll_back` and
:func:`~.prefetch.start_prefetches`: whom a pass may claim (:func:`can_claim`, :func:`idle`)
and the claim itself (:func:`claim`: a new attempt recorded on the pod, then its drain; or,
prefetching, no drain yet). :func:`claim_prefetched` drains a unit whose prefetch verified, for
the attempt it already runs.

A claim is a new attempt, so it rests on what the agent says in this pass: that it answers and
runs no update. A rollback claim is no exception: an operator stopped between a unit's
``Settle(Failed)`` and its ``AbortUpdate`` (a crash, the Lease fence) left the failed attempt
running, and a rollback claimed over it recorded a second attempt on a pod whose agent ran the
first (found by the simulation tier). What it says is the claim's premise
(:class:`~.context.Premise`): the caller applies the claim only while the agents still say it.
"""

from __future__ import annotations

from weightroll_operator.domain.actions import Claim, GateOff
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.gate_vouch import GateVouch
from weightroll_operator.domain.model import (
    AgentView,
    OwnerKey,
    PodView,
    UnitState,
    UpdateId,
    WeightState,
)
from weightroll_operator.domain.plan.context import PassContext, target_source, unit_label
from weightroll_operator.domain.standing import vouch_now, vouch_of


def idle(agent: AgentView | None) -> bool:
    """The agent answered and runs no update: a new attempt may be recorded on its pod."""
    return agent is not None and agent.reachable and not agent.active_update_id


def can_claim(pod: PodView, agent: AgentView | None, owner: OwnerKey, version: str) -> bool:
    """Claim only a pod whose agent answers at a known version (``AgentView.claimable``), or
    one this WeightUpdate already tried at this version (a retry: its previous weights are
    known) whose ranks answer but disagree on the version (a failed commit left them mixed).

    Never a booting one (vLLM not answering), whoever tried it before: the claim would count
    its boot time against the update timer, fail the unit and, with ``onFailure: Rollback``,
    roll the fleet back.
    """
    if not idle(agent):
        return False
    assert agent is not None
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


_NO_STATE = WeightState(
    state=UnitState.DRAINING, by=OwnerKey("-"), version="-", update_id=UpdateId("-")
)


def _prev(pod: PodView) -> WeightState:
    return pod.state if pod.state is not None else _NO_STATE


def claim(
    ctx: PassContext, unit: Unit, *, rollback_of: str | None = None, prefetch: bool = False
) -> None:
    """Record a new attempt on every pod of ``unit`` and drain it; with ``prefetch`` the
    attempt is recorded as ``Prefetching`` and the unit keeps serving (gate and traffic label
    untouched) until :func:`claim_prefetched`."""
    owner, now = ctx.fleet.owner, ctx.now
    tl = ctx.spec.strategy.traffic_label
    # What the pod serves and that it runs no update, and, for a pod not ours yet, that no
    # older WeightUpdate selects it (a claim is a new attempt: see the module docstring).
    ctx.rest_on(unit.pods, peers=any(p.owner != owner for p in unit.pods))
    for pod in unit.pods:
        agent = ctx.fleet.agents.get(pod.name)
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
                update_id=ctx.fleet.attempt_id(pod.state.previous_version, attempt, rollback=True),
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
                and prior.version == ctx.spec.version
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
                state=UnitState.PREFETCHING if prefetch else UnitState.DRAINING,
                by=owner,
                version=ctx.spec.version,
                source=target_source(ctx.spec),
                update_id=ctx.fleet.attempt_id(ctx.spec.version, attempt),
                previous_version=previous,
                previous_source=source,
                started_at=timestamp(now),
                traffic_label_value=pod.labels.get(tl)
                if tl and tl in pod.labels
                else (prior.traffic_label_value if again and prior is not None else None),
                attempt=attempt,
                # the gate keeps its vouch until a write of ours changes it: a prefetch keeps
                # it True, and a drain may never land (an operator stopped between the writes)
                gate=_kept_vouch(pod, agent),
            )
        if prefetch:
            ctx.actions.append(Claim(pod, owner, st))
            continue
        remove = tl if tl and tl in pod.labels else None
        ctx.actions.append(Claim(pod, owner, st, remove_label=remove))
        ctx.actions.append(GateOff(pod, message=f"Draining for weights {st.version}"))
    if prefetch:
        message = f"Prefetching {unit_label(unit)} for weights {ctx.spec.version}; still serving"
        ctx.emit(Reason.UNIT_PREFETCHING, message, pods=unit.pods)
    elif rollback_of is not None:
        ctx.emit(
            Reason.UNIT_ROLLING_BACK,
            f"Draining {unit_label(unit)} to roll back from {rollback_of}",
            pods=unit.pods,
        )
    else:
        message = f"Draining {unit_label(unit)} for weights {ctx.spec.version}"
        ctx.emit(Reason.UNIT_DRAINING, message, pods=unit.pods)
    ctx.progressed = True


def _kept_vouch(pod: PodView, agent: AgentView | None) -> GateVouch | None:
    """What the gate of a pod being claimed vouches for: what its record says (a prefetch keeps
    the pod serving, and ``plan.restore.withdraw`` judges it in this pass), else what the
    claim's fresh answer says it serves (``domain.gate_vouch``)."""
    if pod.gate is not True:
        return None
    kept = vouch_of(pod.state)
    if kept is not None:
        return kept
    if agent is None or not agent.version:
        return None
    return vouch_now(pod, agent, agent.version)


def claim_prefetched(ctx: PassContext, unit: Unit) -> None:
    """Drain ``unit``, whose agents hold its attempt's checkpoint verified (``Prefetched``):
    the same attempt, now ``Draining``; its update timer starts here, at the drain."""
    owner, tl = ctx.fleet.owner, ctx.spec.strategy.traffic_label
    for pod in unit.pods:
        assert pod.state is not None
        st = pod.state.evolve(state=UnitState.DRAINING, started_at=timestamp(ctx.now))
        remove = tl if tl and tl in pod.labels else None
        ctx.actions.append(Claim(pod, owner, st, remove_label=remove))
        ctx.actions.append(GateOff(pod, message=f"Draining for weights {st.version}"))
    message = f"Draining {unit_label(unit)} for weights {ctx.spec.version} (prefetched)"
    ctx.emit(Reason.UNIT_DRAINING, message, pods=unit.pods)
