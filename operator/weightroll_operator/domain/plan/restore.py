"""Steps 6 and 7 on settled pods: :func:`restore` gives traffic back to pods that serve the
target, :func:`withdraw` takes back a verdict its agent contradicts (``domain.standing``).
"""

from __future__ import annotations

from dataclasses import replace

from weightroll_operator.domain.actions import Claim, Emit, GateOff, GateOn, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import (
    LABEL_WEIGHT_VERSION,
    AgentView,
    PodView,
    SourceRef,
    UnitState,
    WeightState,
)
from weightroll_operator.domain.plan.classify import Seen, serves
from weightroll_operator.domain.plan.context import PassContext, PodClass
from weightroll_operator.domain.standing import gate_breach, vouch_now, vouch_of, withdrawal


def restore(ctx: PassContext, seen: Seen, back_to: tuple[str, SourceRef] | None = None) -> None:
    """Step 6: settled pods at the target whose traffic is off (new pods, or a restart between
    the GateOn and the Settle) get their gate back; only an agent ready at the target version
    vouches for it, and for a pod this WeightUpdate verified only its recorded attempt's live
    commit (or ranks that booted at the version: a cold engine on it is the oracle itself).

    During a rollback (``back_to``: :func:`rollback_target`) the target is what the fleet
    returns to: a pod this WeightUpdate never touched that serves it (a new pod) gets its gate
    too. Left drained, it held the whole budget, the rollback took no slot, and the halted
    WeightUpdate stayed ``RollingBack`` for ever, blocking every younger one over its pods
    (found by the simulation tier)."""
    owner, version = ctx.fleet.owner, ctx.spec.version
    if back_to is not None:
        _restore_untouched(ctx, seen, *back_to)
    for pod in ctx.fleet.pods:
        if seen.classes[pod.name] is not PodClass.UPDATED or pod.gate is True or pod.stale:
            continue
        agent = ctx.fleet.agents.get(pod.name)
        if agent is None or not (agent.reachable and agent.ready and agent.version == version):
            continue
        st = pod.state
        ours = st is not None and st.by == owner and st.state is UnitState.VERIFIED
        if ours and st is not None and agent.committed_update_id not in (None, st.update_id):
            continue
        if not ctx.take_steps(1):
            return
        ctx.actions.append(GateOn(pod, version=version, reason="ServingTarget"))
        message = f"Restored traffic to {pod.name}, ready at {version}"
        ctx.emit(Reason.UNIT_RESTORED, message, pods=(pod,))


def _restore_untouched(ctx: PassContext, seen: Seen, version: str, source: SourceRef) -> None:
    owner = ctx.fleet.owner
    for pod in ctx.fleet.pods:
        st = pod.state
        if seen.classes[pod.name] is not PodClass.PENDING or pod.gate is True or pod.stale:
            continue
        if st is not None and st.attempted_by(owner):
            continue  # touched: the rollback itself decides it
        if not serves(ctx.fleet.agents.get(pod.name), version, source) or not ctx.take_steps(1):
            continue
        ctx.actions.append(GateOn(pod, version=version, reason="ServingRollbackTarget"))
        message = f"Restored traffic to {pod.name}, ready at {version} (the rollback's target)"
        ctx.emit(Reason.UNIT_RESTORED, message, pods=(pod,))


def withdraw(ctx: PassContext) -> None:
    """Step 7: a verdict of this WeightUpdate that a ready agent contradicts is withdrawn at
    once (``domain.standing``), unless this pass drains the pod already (its claim rewrites the
    record); and every gate of ours that stays True is judged on what it vouches for
    (``domain.gate_vouch``), whatever its record's state. The agent's answer is the premise of a
    withdrawal or a re-attestation, as it is a claim's (:class:`~.context.Premise`)."""
    owner = ctx.fleet.owner
    # A pod whose gate step 6 sets again is withdrawn too: its record still named the old
    # verdict after that pass, Ready (a pod restored at a reverted spec's version, found by the
    # simulation tier); the gate is attested already, so only the record follows.
    gated = {a.pod.name for a in ctx.actions if isinstance(a, GateOn)}
    drained = {a.pod.name for a in ctx.actions if isinstance(a, GateOff)}
    # A claim to prefetch keeps the pod serving under its gate: the claim's record is judged.
    claimed = {a.pod.name: a.state for a in ctx.actions if isinstance(a, Claim)}
    acted = {a.pod.name for a in ctx.actions if not isinstance(a, Emit | GateOn | Claim)}
    for pod in ctx.fleet.pods:
        st = pod.state
        if pod.name in acted or pod.stale:
            continue
        agent = ctx.fleet.agents.get(pod.name)
        if st is None:
            if pod.name in gated and agent is not None:
                _record_vouch(ctx, pod, st, agent)
            continue
        if pod.name in claimed:
            if pod.name not in drained | gated:
                _judge_gate(ctx, pod, claimed[pod.name], agent, rewrite=Claim)
            continue
        why = withdrawal(st, agent, owner)
        if why is None:
            judged = st.by == owner and not st.state.in_flight and pod.name not in gated
            if judged and _judge_gate(ctx, pod, st, agent, rewrite=None):
                continue
            if pod.name in gated and agent is not None:
                _record_vouch(ctx, pod, st, agent)
            elif agent is not None and agent.reachable and agent.ready:
                _reaffirm(ctx, pod, st)
            continue
        if agent is None or agent.version is None:
            continue
        ctx.rest_on((pod,))
        # The gate is attested for what the agent serves *before* the verdict is recorded
        # withdrawn: an operator stopped between the two writes (a crash, the Lease fence)
        # leaves the verdict standing, so its successor withdraws it again, both writes. In
        # the other order it left `Withdrawn` with the gate still set for the old weights, and
        # nothing withdraws a verdict twice (found by the simulation tier with `leader_lost`).
        gate = st.gate
        if pod.gate is True and pod.name not in gated:
            message = f"Serving {agent.version}: {why} (its verdict at {st.version} withdrawn)"
            ctx.actions.append(
                GateOn(pod, version=agent.version, reason="Reattested", message=message[:1000])
            )
        if pod.gate is True or pod.name in gated:
            gate = vouch_now(pod, agent, agent.version)
        labels: dict[str, str | None] = {LABEL_WEIGHT_VERSION: agent.version}
        ctx.actions.append(
            Settle(pod, st.evolve(state=UnitState.WITHDRAWN, reason=why, gate=gate), labels=labels)
        )
        ctx.emit(
            Reason.UNIT_WITHDRAWN,
            f"Withdrew the verdict of {pod.name} at {st.version}: {why}",
            pods=(pod,),
        )


def _judge_gate(
    ctx: PassContext,
    pod: PodView,
    st: WeightState,
    agent: AgentView | None,
    rewrite: type[Claim] | None,
) -> bool:
    """The gate of ``pod``, True, judged on its record ``st``'s vouch (``domain.gate_vouch``):
    attested again for what a ready agent serves now, or taken off when nothing answers for
    the containers (a drain never waits for the budget: it is what keeps traffic safe).
    ``rewrite``: the record is this pass's claim, written again with the new vouch. Whether
    the pod was acted on."""
    breach = gate_breach(st, pod, agent)
    if breach is None:
        return False
    if breach.now is not None:
        ctx.rest_on((pod,))
    if breach.now is None:
        vouched = vouch_of(st)
        what = f"{vouched.version} on containers {vouched.incarnation}" if vouched else "?"
        message = f"Draining {pod.name}: {breach.why} (its gate vouched for {what})"
        ctx.actions.append(GateOff(pod, reason="VerdictOutlived", message=message[:1000]))
        ctx.emit(Reason.UNIT_WITHDRAWN, message[:1000], warning=True, pods=(pod,))
        return True
    message = f"Serving {breach.now.version}: {breach.why}"
    ctx.actions.append(
        GateOn(pod, version=breach.now.version, reason="Reattested", message=message[:1000])
    )
    again = st.evolve(gate=breach.now)
    if rewrite is Claim or (st.state.running and pod.owner == ctx.fleet.owner):
        ctx.actions.append(Claim(pod, ctx.fleet.owner, again))
    else:
        ctx.actions.append(Settle(pod, again, release=pod.owner != ctx.fleet.owner))
    return True


def _record_vouch(ctx: PassContext, pod: PodView, st: WeightState | None, agent: AgentView) -> None:
    """Step 6 set the gate of ``pod`` True: its record keeps what the gate vouches for now,
    written with it as a verdict's is (``domain.gate_vouch``), whatever the record's state.

    Only a verdict or a withdrawal once got it: a pod restored with a failure or rollback
    record (retried), or with no record at all (it served the version already), kept none, so
    no later pass judged its gate, and once its containers restarted onto other weights it
    served them in traffic under the gate set for the version. A pod without a record of ours
    gets one that holds only the vouch (``Attested``: no attempt, no verdict). A record of
    another WeightUpdate is not ours to rewrite, nor is a running attempt's (its own step
    writes it)."""
    owner = ctx.fleet.owner
    if not agent.version or (st is not None and (st.by != owner or st.state.running)):
        return
    if st is None:
        st = WeightState(
            state=UnitState.ATTESTED,
            by=owner,
            version=agent.version,
            update_id=ctx.fleet.attempt_id(agent.version, 0),
            source=agent.source,
        )
    gate = vouch_now(pod, agent, agent.version)
    ctx.actions.append(Settle(pod, st.evolve(gate=gate), release=False))


def _reaffirm(ctx: PassContext, pod: PodView, st: WeightState) -> None:
    """A verdict made on earlier containers that the new containers' agent confirms (ready,
    not contradicted) is recorded for them, so a later silence of that agent is no reason to
    drain the pod (``domain.standing``)."""
    if st.by != ctx.fleet.owner or st.incarnation in (None, pod.incarnation):
        return
    if st.state not in (UnitState.VERIFIED, UnitState.ROLLED_BACK) or not pod.incarnation:
        return
    gate = vouch_of(st)
    if gate is not None and gate.incarnation == st.incarnation:
        gate = replace(gate, incarnation=pod.incarnation)
    ctx.actions.append(
        Settle(pod, st.evolve(incarnation=pod.incarnation, gate=gate), release=False)
    )
