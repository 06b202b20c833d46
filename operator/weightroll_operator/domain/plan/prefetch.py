"""Steps 2b and 5c: units that prefetch before they are claimed (``strategy.prefetch.mode:
Host``, issue 30 item 3).

A prefetch costs host memory, not availability, so it runs ahead of the ``maxUnavailable``
budget, bounded by its own ``strategy.prefetch.maxConcurrent``::

    pending --(step 5c, :func:`start_prefetches`: Claim as Prefetching; gate and traffic label
              untouched, no budget)--> Prefetching: StartUpdate (``awaitSwap``) on every pod
      -> every agent ``Prefetched``: the unit is *ready*; step 5b (``start_units``) drains it
         (``claim_prefetched``: the same attempt, ``Draining``) within ``maxUnavailable``
      -> drained: ``SwapUpdate`` (``advance``), then as any unit: verify, traffic back
      -> an agent's prefetch failed: the unit fails (``PrefetchFailed: <agent reason>``) but
         keeps serving its old, verified weights, gate open; it counts toward
         ``maxFailedReplicas`` as any failed unit (the spec's files failed on it), and not
         toward ``maxUnavailable`` (``start.drained_failure``)
      -> the attempt ended without a verdict (the agent's swap deadline, an abort, a restart),
         the spec moved on, or the rollout halted: aborted if it still runs, then released
         (``Withdrawn``, serving): wanted again, no failure

Ready units are drained before new prefetches start, so the prefetches run while the drained
batch swaps. Canary units are drained first and prefetch inside the drain (the canary is the
test); prefetching ahead starts once the canary's verdict stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine_agent.protocol import UpdatePhase
from weightroll_operator.api.v1alpha1 import PrefetchMode, WeightUpdateSpec
from weightroll_operator.domain.actions import AbortUpdate, Claim, Settle, StartUpdate
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.model import PodView, UnitState
from weightroll_operator.domain.plan.advance import fail_unit, outdated
from weightroll_operator.domain.plan.claim import claim
from weightroll_operator.domain.plan.classify import Seen
from weightroll_operator.domain.plan.context import (
    PREFETCH_FAILED,
    PassContext,
    PodClass,
    unit_label,
)
from weightroll_operator.domain.plan.deadlines import Halt
from weightroll_operator.domain.wire import build_request

__all__ = ["Staged", "advance_prefetches", "prefetch_ahead", "start_prefetches"]

#: Agent reason codes of an attempt that ended without a verdict on the files: nobody swapped
#: in time, an abort, the agent (or a rank) restarted and lost the staging.
_NO_VERDICT = ("swap_deadline:", "aborted:", "agent_restarted:", "agent_stopped:", "prefetch_lost:")
#: Agent phases of an attempt that has not verified its prefetch yet.
_READING = frozenset({UpdatePhase.PENDING, UpdatePhase.PREFETCHING})


def prefetch_ahead(spec: WeightUpdateSpec) -> bool:
    """Units prefetch before they are claimed (and are claimed only once they did)."""
    return spec.strategy.prefetch.mode is PrefetchMode.HOST


def max_concurrent(spec: WeightUpdateSpec, seen: Seen) -> int:
    """Units that may prefetch (or wait, verified, for the drain) at once: one batch ahead
    unless ``maxConcurrent`` says otherwise."""
    return spec.strategy.prefetch.max_concurrent or seen.max_unavailable


@dataclass(frozen=True, slots=True)
class Staged:
    """Step 2b: the units prefetching ahead of their drain."""

    #: Every pod's agent holds the attempt's checkpoint verified: may be drained now.
    ready: tuple[Unit, ...] = ()
    #: Keys of every unit prefetching or ready (against ``maxConcurrent``; at work for the
    #: progress deadline).
    keys: frozenset[str] = frozenset()


def advance_prefetches(ctx: PassContext, seen: Seen, halted: bool) -> Staged:
    """Step 2b: move each prefetching unit one step; ``halted``: the rollout stopped (abort
    intent persisted), so every prefetch is given up."""
    ready: list[Unit] = []
    keys: set[str] = set()
    for unit in seen.prefetching:
        staged = [p for p in unit.pods if seen.classes[p.name] is PodClass.PREFETCHING]
        if unit.key in seen.frozen:
            keys.add(unit.key)
            continue
        outcome = _advance_unit(ctx, unit, staged, halted)
        if outcome is not None:
            keys.add(unit.key)
            if outcome:
                ready.append(unit)
    return Staged(tuple(sorted(ready, key=lambda u: u.key)), frozenset(keys))


def _advance_unit(ctx: PassContext, unit: Unit, staged: list[PodView], halted: bool) -> bool | None:
    """One prefetching unit one step: True ready, False still prefetching, None ended."""
    spec = ctx.spec
    # A unit staged in part (a pod's claim write failed, a pod joined its group) is given up
    # and staged whole again: it is drained whole or not at all.
    give_up = (
        halted
        or len(staged) != len(unit.pods)
        or any(p.state is not None and outdated(spec, p.state) for p in staged)
    )
    failed: dict[str, str] = {}
    ended: list[PodView] = []  # the attempt ended on the agent without a verdict
    running: list[PodView] = []
    prefetched = 0
    for pod in staged:
        st = pod.state
        assert st is not None
        agent, update = ctx.answer(pod)
        if agent is None or not agent.reachable:
            running.append(pod)
        elif update is None:
            if agent.active_update_id == st.update_id:
                running.append(pod)  # it runs; its record was not read this pass
            elif agent.active_update_id or give_up:
                ended.append(pod)  # something else runs there (a push): not ours to wait on
            else:
                if ctx.take_steps(1):
                    ctx.actions.append(StartUpdate(pod, build_request(spec, st)))
                running.append(pod)
        elif update.phase is UpdatePhase.FAILED and not _expired(update.reasons):
            failed[pod.name] = "; ".join(update.reasons) or "Failed"
        elif update.phase.terminal:
            ended.append(pod)
        elif update.phase is UpdatePhase.PREFETCHED and not give_up:
            prefetched += 1
        else:
            # reading, or (after a go we did not give) draining itself: wait for its end
            if give_up and (update.phase in _READING or update.phase is UpdatePhase.PREFETCHED):
                ctx.actions.append(AbortUpdate(pod, st.update_id))
            running.append(pod)
    if failed and not give_up:
        _fail(ctx, unit, staged, failed)
        return None
    if failed or ended:
        # the unit's attempt is over: abort what still runs of it, release what ended
        for pod in running:
            assert pod.state is not None
            ctx.actions.append(AbortUpdate(pod, pod.state.update_id))
        if not running:
            _release(ctx, unit, staged, failed)
            return None
        return False
    return prefetched == len(staged)


def _expired(reasons: tuple[str, ...]) -> bool:
    return any(reason.startswith(_NO_VERDICT) for reason in reasons)


def _fail(ctx: PassContext, unit: Unit, staged: list[PodView], failed: dict[str, str]) -> None:
    """The prefetch failed on a pod (``failed``: the agents' reasons): the unit fails, serving
    its old weights (gate open); the rest of its attempt is aborted after the verdict."""
    reason = PREFETCH_FAILED + "; ".join(
        why if len(staged) == 1 else f"{name}: {why}" for name, why in sorted(failed.items())
    )
    fail_unit(ctx, unit, staged, reason)
    ctx.actions.extend(
        AbortUpdate(p, p.state.update_id) for p in staged if p.name not in failed and p.state
    )


def _release(ctx: PassContext, unit: Unit, staged: list[PodView], failed: dict[str, str]) -> None:
    """The attempt ended without a verdict: the pods serve what they served; wanted again."""
    why = "; ".join(sorted(set(failed.values()))) or "the prefetch ended without a swap"
    for pod in staged:
        st = pod.state
        assert st is not None
        reason = f"PrefetchReleased: {why}"
        ctx.actions.append(Settle(pod, st.evolve(state=UnitState.WITHDRAWN, reason=reason)))
    ctx.emit(
        Reason.UNIT_PREFETCH_RELEASED,
        f"Released {unit_label(unit)} after its prefetch ended: {why}"[:1000],
        pods=staged,
    )
    ctx.progressed = True


def start_prefetches(
    ctx: PassContext,
    seen: Seen,
    halt: Halt,
    staged: Staged,
    startable: Callable[[Unit], bool],
) -> None:
    """Step 5c: start prefetching pending units (``startable``: as step 5b would claim them)
    while fewer than ``maxConcurrent`` units prefetch; after the canary only."""
    if not prefetch_ahead(ctx.spec) or not halt.canary_done:
        return
    drained = {
        a.pod.unit
        for a in ctx.actions
        if isinstance(a, Claim) and a.state.state is not UnitState.PREFETCHING
    }
    free = max_concurrent(ctx.spec, seen) - len(staged.keys - drained)
    for unit in sorted(halt.pending, key=lambda u: u.key):
        if free <= 0:
            break
        if unit.key in drained or not startable(unit):
            continue
        if not ctx.take_steps(len(unit.pods)):
            break
        free -= 1
        claim(ctx, unit, prefetch=True)
        ctx.progressed = True
