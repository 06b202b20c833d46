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
  own readiness probe guards it meanwhile).

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

from weightroll_operator.domain.model import AgentView, OwnerKey, UnitState, WeightState

__all__ = ["contradicts", "withdrawal"]


def contradicts(st: WeightState | None, agent: AgentView | None, owner: OwnerKey) -> bool:
    """The agent reports a commit other than the one ``owner`` verified (``st``)."""
    if st is None or st.by != owner or st.state is not UnitState.VERIFIED:
        return False
    if agent is None or not agent.reachable:
        return False
    return agent.committed_update_id not in (None, st.update_id)


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
