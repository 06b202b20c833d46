"""A verdict stands only while the pod's agent still says so (pure).

A unit verified at a version is not verified for good: a trainer may push other weights under
the same label, and an agent restarted without its state comes back on the boot weights, ready
and in traffic. The planner once asked a verified, Ready pod nothing again, so the status kept
"verified at v2" while the pod served other weights (issue 27 item 6). So:

* **re-observed**: every verified pod's agent is asked like any other (:func:`queries` in
  ``plan``); the reconciler answers a pod in traffic from its cache for at most
  ``WEIGHTROLL_STATE_TTL`` seconds (30, jittered), so a verified fleet costs one
  ``GET /v1/state`` per pod per TTL, not one per pass;
* **re-judged**: an answer that no longer vouches for the verdict (another version, other or
  unknown files, or a commit other than the verified attempt's) makes the pod wanted again:
  ``Pending`` in the status, re-converged by a new attempt, drained only within the budget
  (``domain.availability``) like any pod in traffic, whether the rollout finished or not
  (``domain.halts``);
* an agent that does not answer leaves the verdict standing (it cannot be re-judged; the pod's
  own readiness probe guards it meanwhile), **but only on the containers it was made on**: a
  verdict records the pod's incarnation (its uid, IP and container restart counts), and once
  the containers restarted it vouches for nothing. The readiness probe does not guard that
  case: an agent restarted without its state onto the boot weights is ready, and our gate,
  a pod condition, outlives the restart. With the agent unreachable from the operator (a
  network policy, a partition) such a pod served its boot weights in traffic under a gate
  set for v2, listed ``Verified`` at v2 in a ``Succeeded`` status, for as long as the
  partition lasted (found by the simulation tier). So a verdict that outlived its containers
  while no answer re-judges it (:func:`outlived`) fails closed: the gate goes off and the pod
  is ``Unknown`` until its agent answers; one the new containers' agent confirms is recorded
  for them (``plan.restore.withdraw``).

  Containers that turned NotReady while their agent is silent are no longer *seen* to be the
  ones the verdict was made on either: vLLM restarting under its agent shows first as
  ``ContainersReady=False``, before kubelet counts the restart. Such a pod was listed
  ``Verified`` at v2 while its ranks served their boot weights v1 (found by the simulation
  tier). It is the same case, caught earlier: the verdict vouches for nothing seen, so the pod
  is ``Unknown``. Its gate stays: kubelet keeps it out of traffic already, and the containers
  that come back ready without a restart are those whose agent held them out (its ``/readyz``
  sees the change; a vLLM restart under it holds the pod until a full update). Taking the gate
  off there would guard nothing, yet keep every pod a readiness blip touched out of traffic
  for as long as a partition lasts, beyond ``maxUnavailable``. Only replaced containers
  (:attr:`Outlived.replaced`) need our gate to keep them out.

The *gate* is judged apart from the verdict (:func:`gate_breach`, ``domain.gate_vouch``): what a
GateOn of ours vouched for is kept with the record whatever state it moves to, so a gate under a
record that is no verdict (a verified pod claimed to prefetch, serving on) is judged too.

A commit id the agent no longer reports (``None``: ranks that booted at the version after a
restart report no commit) is not a contradiction: the label and files are checked instead.

* **withdrawn at once**: a re-judged pod may have to wait for the budget before it is drained,
  and until then its records must not keep saying what is no longer true. A pod's
  ``weight-state`` ``Verified`` at v2 and its ``weight-version=v2`` label (which a Service may
  select on) stayed while its agent, restarted without its state, served the boot weights v1,
  Ready, for as long as other units held the budget (found by the simulation tier). So a verdict
  an answering, ready agent contradicts is withdrawn in the pass that sees it
  (:func:`withdrawal`): the state becomes ``Withdrawn`` (the attempt count kept, so ids never
  repeat), the version label follows what the agent serves, and the gate, True, is written
  again for those weights (a ready agent's ranks either booted on them, and a cold engine is
  the oracle itself, or committed them through a verified update).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightroll_operator.domain.gate_vouch import Breach, GateVouch, breach
from weightroll_operator.domain.model import AgentView, OwnerKey, PodView, UnitState, WeightState

__all__ = [
    "Outlived",
    "contradicts",
    "gate_breach",
    "outlived",
    "vouch_now",
    "vouch_of",
    "withdrawal",
]


@dataclass(frozen=True, slots=True)
class Outlived:
    """Why a verdict vouches for nothing now (:func:`outlived`)."""

    why: str
    #: The containers the verdict was made on were replaced (restarted): their successors'
    #: readiness probe knows no verdict, so only our gate keeps the pod out of traffic. Else
    #: they only turned NotReady, and kubelet keeps the pod out already.
    replaced: bool


def contradicts(st: WeightState | None, agent: AgentView | None, owner: OwnerKey) -> bool:
    """The agent reports a commit other than the one ``owner`` verified (``st``)."""
    if st is None or st.by != owner or st.state is not UnitState.VERIFIED:
        return False
    if agent is None or not agent.reachable:
        return False
    return agent.committed_update_id not in (None, st.update_id)


def outlived(
    st: WeightState | None, pod: PodView, agent: AgentView | None, owner: OwnerKey
) -> Outlived | None:
    """Why ``owner``'s verdict ``st`` no longer vouches for ``pod`` though no agent answer
    contradicts it: the agent does not answer, and the containers the verdict was made on are
    not seen serving: they restarted since (the pod's incarnation changed) or kubelet reports
    them not ready (module doc); ``None`` when it stands or an answer judges it."""
    if st is None or st.by != owner or st.incarnation is None:
        return None
    if st.state not in (UnitState.VERIFIED, UnitState.ROLLED_BACK):
        return None
    if agent is not None and agent.reachable:
        return None
    if st.incarnation != pod.incarnation:
        why = "its containers restarted since its verdict and its agent does not answer"
        return Outlived(why, replaced=True)
    if pod.containers_ready is False:
        why = "its containers are not ready and its agent does not answer"
        return Outlived(why, replaced=False)
    return None


def withdrawal(st: WeightState | None, agent: AgentView | None, owner: OwnerKey) -> str | None:
    """Why ``owner``'s verdict ``st`` (``Verified`` or ``RolledBack``) no longer describes the
    pod, judged by a reachable, ready agent; ``None`` when it stands (or cannot be judged)."""
    if st is None or st.by != owner:
        return None
    if st.state not in (UnitState.VERIFIED, UnitState.ROLLED_BACK):
        return None
    if agent is None or not agent.reachable or not agent.ready or not agent.version:
        return None
    if agent.version != st.version:
        return f"the agent serves {agent.version}, not {st.version}"
    if st.source is not None and not st.source.same_files(agent.source):
        return f"the agent serves {st.version} from other files than the verdict's"
    if agent.committed_update_id not in (None, st.update_id):
        return f"the agent serves {st.version} committed by {agent.committed_update_id}"
    return None


def gate_breach(st: WeightState | None, pod: PodView, agent: AgentView | None) -> Breach | None:
    """Why the gate of ``pod``, True, no longer vouches for what it serves, judged on its
    record's vouch (``st.gate``, ``domain.gate_vouch``) whatever the record's state; ``None``
    while it stands, or when the record holds no vouch (the gate is not ours to judge)."""
    vouch = vouch_of(st)
    if vouch is None or pod.gate is not True:
        return None
    if agent is None:
        agent = _SILENT
    return breach(
        vouch,
        pod.incarnation,
        reachable=agent.reachable,
        ready=agent.ready,
        version=agent.version,
        committed_update_id=agent.committed_update_id,
    )


def vouch_of(st: WeightState | None) -> GateVouch | None:
    """What the gate under record ``st`` vouches for: its ``gate`` field; on a record older
    than the field, what its own GateOn vouched for: a verdict's version, update id and
    incarnation, or a prefetch's previous version on unknown containers (fail closed while
    its agent is silent, ``domain.gate_vouch``)."""
    if st is None or st.gate is not None:
        return None if st is None else st.gate
    if st.state in (UnitState.VERIFIED, UnitState.ROLLED_BACK):
        return GateVouch(st.version, st.update_id, st.incarnation)
    if st.state is UnitState.PREFETCHING and st.previous_version:
        return GateVouch(st.previous_version)
    return None


def vouch_now(pod: PodView, agent: AgentView, version: str) -> GateVouch:
    """What a gate set True now for ``version`` vouches for: ``agent``'s commit on these
    containers."""
    committed = agent.committed_update_id if agent.version == version else None
    return GateVouch(version, committed, pod.incarnation or None)


_SILENT = AgentView(reachable=False)
