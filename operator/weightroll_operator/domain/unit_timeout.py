"""What a unit's ``updateTimeoutSeconds`` does to each of its pods: the verdict is the agent's.

A timeout asks the agent to abort; it does not decide the outcome by itself, because the abort
may lose the race to a commit (the agent answers 409: the update committed first). Deciding
"failed" in the same pass as the abort failed a unit that had succeeded, persisted the halt, and
with ``onFailure: Rollback`` rolled the fleet back for it (issue 27 item 4). So, per pod of a
timed-out unit (:func:`on_timeout`):

* an update still running: abort it and wait for the agent's record: ``Aborted`` fails the
  unit (:func:`aborted_reason`), ``Committed`` verifies it as usual;
* an abort not confirmed within :data:`ABORT_GRACE_SECONDS` (the agent keeps saying it runs):
  fail without the agent's word, the pod stays drained (fail closed);
* committed but not ready (the ranks serve the attempt, generation not resumed): nothing to
  abort; fail it (it stays drained). Sending an abort there got a 409 on every pass, which
  skipped the Settle behind it and wedged the unit in flight;
* an agent that does not answer, or that never accepted the update: fail; the abort goes out
  after the Settle, best effort, so a failed abort call cannot hold the verdict back.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_agent.protocol import UpdatePhase
from weightroll_operator.domain.model import AgentView

__all__ = ["ABORT_GRACE_SECONDS", "TimeoutStep", "aborted_reason", "on_timeout"]

#: How long after the timeout an abort may take to show in the agent's record before the unit
#: fails without it (an agent's abort stops its ranks within seconds).
ABORT_GRACE_SECONDS = 60.0

_TIMEOUT = "UpdateTimeout: no verdict within updateTimeoutSeconds"


@dataclass(frozen=True, slots=True)
class TimeoutStep:
    """One pod's step at its unit's timeout."""

    #: Send ``AbortUpdate`` (after the Settle when :attr:`reason` is set).
    abort: bool
    #: The failure reason; ``None``: wait for the agent's verdict on the abort.
    reason: str | None


def on_timeout(agent: AgentView | None, *, overdue: bool) -> TimeoutStep:
    """The step for one pod of a unit past ``updateTimeoutSeconds``.

    Args:
        agent: this pass's observation of the pod's agent (with its update record).
        overdue: past the timeout by :data:`ABORT_GRACE_SECONDS` too.
    """
    if agent is None or not agent.reachable:
        return TimeoutStep(abort=True, reason=f"{_TIMEOUT} (agent unreachable)")
    update = agent.update
    if update is None:
        return TimeoutStep(abort=True, reason=f"{_TIMEOUT} (the agent never accepted it)")
    if update.phase is UpdatePhase.COMMITTED:
        return TimeoutStep(
            abort=False,
            reason="NotReadyAfterCommit: committed, but not ready within updateTimeoutSeconds",
        )
    if overdue:
        return TimeoutStep(abort=True, reason=f"{_TIMEOUT} (the abort was not confirmed)")
    return TimeoutStep(abort=True, reason=None)


def aborted_reason(why: str, *, timed_out: bool) -> str:
    """The reason of a unit whose agent record says ``Aborted``: ours, after the timeout."""
    return f"{_TIMEOUT} (aborted)" if timed_out else f"UpdateAborted: {why}"
