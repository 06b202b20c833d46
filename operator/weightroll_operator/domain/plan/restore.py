"""Steps 6 and 7 on settled pods: :func:`restore` gives traffic back to pods that serve the
target, :func:`withdraw` takes back a verdict its agent contradicts (``domain.standing``).
"""

from __future__ import annotations

from weightroll_operator.domain.actions import Emit, GateOff, GateOn, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import (
    LABEL_WEIGHT_VERSION,
    PodView,
    SourceRef,
    UnitState,
    WeightState,
)
from weightroll_operator.domain.plan.classify import Seen, serves
from weightroll_operator.domain.plan.context import PassContext, PodClass
from weightroll_operator.domain.standing import Outlived, outlived, withdrawal


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
        if st is not None and st.by == owner:
            continue  # touched: the rollback itself decides it
        if not serves(ctx.fleet.agents.get(pod.name), version, source) or not ctx.take_steps(1):
            continue
        ctx.actions.append(GateOn(pod, version=version, reason="ServingRollbackTarget"))
        message = f"Restored traffic to {pod.name}, ready at {version} (the rollback's target)"
        ctx.emit(Reason.UNIT_RESTORED, message, pods=(pod,))


def withdraw(ctx: PassContext) -> None:
    """Step 7: a verdict of this WeightUpdate that a ready agent contradicts is withdrawn at
    once (``domain.standing``), unless this pass drains the pod already (its claim rewrites the
    record). Judged on a fresh answer only, as a claim is (:attr:`Plan.refresh`)."""
    owner = ctx.fleet.owner
    # A pod whose gate step 6 sets again is withdrawn too: its record still named the old
    # verdict after that pass, Ready (a pod restored at a reverted spec's version, found by the
    # simulation tier); the gate is attested already, so only the record follows.
    gated = {a.pod.name for a in ctx.actions if isinstance(a, GateOn)}
    acted = {a.pod.name for a in ctx.actions if not isinstance(a, Emit | GateOn)}
    for pod in ctx.fleet.pods:
        st = pod.state
        if pod.name in acted or pod.stale or st is None:
            continue
        agent = ctx.fleet.agents.get(pod.name)
        gone = outlived(st, pod, agent, owner)
        if gone is not None:
            _fail_closed(ctx, pod, st, gone)
            continue
        why = withdrawal(st, agent, owner)
        if why is None and agent is not None and agent.reachable and agent.ready:
            _reaffirm(ctx, pod, st)
        if why is None or agent is None or agent.version is None:
            continue
        if pod.name in ctx.fleet.cached:
            ctx.refresh.add(pod.name)
            if not ctx.provisional:
                continue
        # The gate is attested for what the agent serves *before* the verdict is recorded
        # withdrawn: an operator stopped between the two writes (a crash, the Lease fence)
        # leaves the verdict standing, so its successor withdraws it again, both writes. In
        # the other order it left `Withdrawn` with the gate still set for the old weights, and
        # nothing withdraws a verdict twice (found by the simulation tier with `leader_lost`).
        if pod.gate is True and pod.name not in gated:
            message = f"Serving {agent.version}: {why} (its verdict at {st.version} withdrawn)"
            ctx.actions.append(
                GateOn(pod, version=agent.version, reason="Reattested", message=message[:1000])
            )
        labels: dict[str, str | None] = {LABEL_WEIGHT_VERSION: agent.version}
        ctx.actions.append(
            Settle(pod, st.evolve(state=UnitState.WITHDRAWN, reason=why), labels=labels)
        )
        ctx.emit(
            Reason.UNIT_WITHDRAWN,
            f"Withdrew the verdict of {pod.name} at {st.version}: {why}",
            pods=(pod,),
        )


def _fail_closed(ctx: PassContext, pod: PodView, st: WeightState, gone: Outlived) -> None:
    """A verdict that outlived its containers, with no answer to re-judge it
    (``domain.standing``): nothing vouches for what the pod serves (it is ``Unknown``), so
    replaced containers leave traffic (a drain never waits for the budget: it is what keeps
    traffic safe). Containers that only turned NotReady are out of traffic already, and
    their own agent's probe keeps them out if what they serve changed."""
    if pod.gate is not True or not gone.replaced:
        return
    message = (
        f"Draining {pod.name}: {gone.why} (its verdict at {st.version} vouches for nothing now)"
    )
    ctx.actions.append(GateOff(pod, reason="VerdictOutlived", message=message[:1000]))
    ctx.emit(Reason.UNIT_WITHDRAWN, message, warning=True, pods=(pod,))


def _reaffirm(ctx: PassContext, pod: PodView, st: WeightState) -> None:
    """A verdict made on earlier containers that the new containers' agent confirms (ready,
    not contradicted) is recorded for them, so a later silence of that agent is no reason to
    drain the pod (``domain.standing``)."""
    if st.by != ctx.fleet.owner or st.incarnation in (None, pod.incarnation):
        return
    if st.state not in (UnitState.VERIFIED, UnitState.ROLLED_BACK) or not pod.incarnation:
        return
    ctx.actions.append(Settle(pod, st.evolve(incarnation=pod.incarnation), release=False))
