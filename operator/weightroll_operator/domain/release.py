"""What deleting a WeightUpdate does to the pods it owns (pure): ``release(...) -> Release``.

The finalizer stays until every pod the WeightUpdate owns is released (issue 11, finding 4).
Per owned pod, from what its agent says now:

* an update of this attempt still runs: ``AbortUpdate`` (the pod stays owned; the next round
  sees the verdict);
* the agent serves this attempt's commit live (the update committed before or while it was
  aborted — the real agent answers 409 to aborting a committed update): traffic restored,
  ``Verified``, released;
* the agent is ready (every rank clean at the version it expects, generation resumed, nothing
  held) at a known version: traffic restored, released — ``Verified`` when that is this
  attempt's version, ``RolledBack`` when it is the recorded previous one;
* otherwise (held, poisoned, failed): released but left drained, its reason recorded; the
  operator keeps exporting its drained series, so ``WeightrollReplicaLeftDrained`` keeps firing;
* agent unreachable, unauthorized or unreadable while an update may still run: not released,
  retried with backoff (``pending``).

Released pods get a ``weight-state`` written by ``<owner>~deleted``, so a WeightUpdate
re-created under the same name starts from what the pods serve, not from the old object's
verdicts.

Limitations:
    * An agent that never answers again keeps the finalizer (and the WeightUpdate) until its pod
      is deleted or the finalizer is removed by hand; the ``ReleasePending`` Event names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from weightroll_operator.domain.actions import AbortUpdate, Action, Emit, GateOn, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import (
    LABEL_WEIGHT_VERSION,
    AgentView,
    OwnerKey,
    PodView,
    UnitState,
    UpdateId,
    WeightState,
)
from weightroll_operator.domain.plan import parse_time, serves_attempt
from weightroll_operator.domain.standing import vouch_now

__all__ = ["DELETED_SUFFIX", "Release", "deleted_owner", "release"]

#: Suffix of the ``by`` of states written on deletion (:func:`deleted_owner`).
DELETED_SUFFIX = "~deleted"


def _listed(reason: str, what: str, pods: Mapping[str, str], *, warning: bool = False) -> Emit:
    """One Event naming up to 20 pods (with why, when given)."""
    head = (
        f"Deletion waits for {len(pods)} pods"
        if reason == Reason.RELEASE_PENDING
        else f"Released {len(pods)} pods on deletion {what}"
    )
    listed = "; ".join(f"{n}: {r}" if r else n for n, r in sorted(pods.items())[:20])
    return Emit(reason, f"{head}: {listed}"[:2000], warning=warning)


def deleted_owner(owner: OwnerKey) -> OwnerKey:
    """The ``by`` of states written on deletion: no live WeightUpdate has this key."""
    return OwnerKey(f"{owner}{DELETED_SUFFIX}")


@dataclass(frozen=True, slots=True)
class Release:
    actions: tuple[Action, ...]
    #: Pods whose owner annotation is removed by ``actions``.
    released: tuple[str, ...] = ()
    #: Pods whose traffic ``actions`` restore.
    restored: tuple[str, ...] = ()
    #: Pods released but left drained: pod -> reason.
    left_drained: Mapping[str, str] = field(default_factory=dict)
    #: Since when each left-drained pod is drained (epoch seconds, for the alert series).
    drained_since: Mapping[str, float] = field(default_factory=dict)
    #: Pods not released yet: pod -> why (the finalizer stays; retried with backoff).
    pending: Mapping[str, str] = field(default_factory=dict)


def release(
    pods: Iterable[PodView],
    agents: Mapping[str, AgentView],
    owner: OwnerKey,
    *,
    traffic_label: str | None = None,
    fallback: WeightState | None = None,
) -> Release:
    """Decide the release of every pod ``owner`` owns (see the module docstring).

    Args:
        pods: the namespace's pods (only those whose owner annotation is ``owner`` are acted on).
        agents: what each owned pod's agent said this round (state; the update when in flight).
        owner: the deleted WeightUpdate.
        traffic_label: ``spec.strategy.trafficLabel`` (restored with the traffic).
        fallback: the state to assume for an owned pod without a readable ``weight-state``.
    """
    actions: list[Action] = []
    released: list[str] = []
    restored: list[str] = []
    left: dict[str, str] = {}
    since: dict[str, float] = {}
    pending: dict[str, str] = {}
    gone = deleted_owner(owner)
    for pod in pods:
        if pod.owner != owner:
            continue
        st = pod.state or fallback
        if st is None:
            st = WeightState(
                state=UnitState.FAILED, by=owner, version="unknown", update_id=UpdateId("unknown")
            )
        agent = agents.get(pod.name)
        reachable = agent is not None and agent.reachable
        update = agent.update if agent is not None else None
        if st.state.running:
            if not reachable or agent is None:
                why = agent.error if agent is not None else "not asked"
                pending[pod.name] = f"AgentUnreachable: {why}; the update may still run"
                continue
            if not serves_attempt(agent, st) and update is not None and not update.phase.terminal:
                actions.append(AbortUpdate(pod, st.update_id))
                pending[pod.name] = f"Aborting update {st.update_id} (phase {update.phase.value})"
                continue
        serving = (
            reachable and agent is not None and agent.ready and agent.clean and bool(agent.version)
        )
        labels: dict[str, str | None] = {}
        if traffic_label and st.traffic_label_value is not None:
            labels[traffic_label] = st.traffic_label_value
        if serving and agent is not None and agent.version:
            served = agent.version
            done = (
                UnitState.VERIFIED
                if served == st.version
                else UnitState.ROLLED_BACK
                if served == st.previous_version
                else UnitState.VERIFIED
            )
            labels[LABEL_WEIGHT_VERSION] = served
            gate = st.gate
            if pod.gate is not True:
                # like every GateOn of ours, it records what it vouches for (domain.gate_vouch)
                actions.append(GateOn(pod, version=served, reason="ReleasedServing"))
                gate = vouch_now(pod, agent, served)
            actions.append(
                Settle(
                    pod,
                    st.evolve(
                        state=done,
                        by=gone,
                        version=served,
                        source=agent.source,  # what it serves, not what the record aimed at
                        reason=f"Released on deletion, serving {served}",
                        gate=gate,
                    ),
                    labels=labels,
                )
            )
            restored.append(pod.name)
        else:
            if reachable and agent is not None:
                why = agent.error or (
                    f"agent not ready (serves {agent.version or 'an unknown version'}"
                    f"{'' if agent.clean else ', engine not clean'})"
                )
            else:
                why = agent.error if agent is not None else "agent not asked"
            reason = f"LeftDrained: {st.reason or st.state.value}; {why}"[:300]
            actions.append(
                Settle(
                    pod,
                    st.evolve(state=UnitState.FAILED, by=gone, reason=reason),
                    labels=labels,
                )
            )
            left[pod.name] = reason
            started = parse_time(st.started_at)
            if started is not None:
                since[pod.name] = started.timestamp()
        released.append(pod.name)
    if restored:
        actions.append(
            _listed(Reason.RELEASED, "and restored their traffic", dict.fromkeys(restored, ""))
        )
    if left:
        actions.append(_listed(Reason.LEFT_DRAINED, "but left them drained", left, warning=True))
    if pending:
        actions.append(_listed(Reason.RELEASE_PENDING, "", pending, warning=True))
    return Release(
        actions=tuple(actions),
        released=tuple(released),
        restored=tuple(restored),
        left_drained=left,
        drained_since=since,
        pending=pending,
    )
