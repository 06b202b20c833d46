"""What a claim costs in ``maxUnavailable``: the rollout's slots (pure).

A claim drains a unit and keeps it out of traffic until its reload is verified. What that costs
depends on why the unit is out of traffic now:

* **held by our gate** (every pod has the ``weightroll.io/weights-ready`` gate and it is not
  True: a new pod not admitted yet, a unit we drained): it would not serve before we say so,
  so the claim takes nothing from anyone. Free.
* **held by its agent** (every pod's agent answers, its ranks are up, it runs no update and is
  not ready: a failed update, a vLLM restarted under it, weights changed after their commit —
  generation stays paused until a full update commits): it would not serve before an update
  either. Free as well: when it cost a slot, a failed unit holding a budget of 1 kept such a
  pod out of traffic for ever, never converged (found by the simulation tier).
* **NotReady for a reason outside the rollout** (our gate True, the containers not ready: a
  readiness blip, a vLLM restart): it would be back in traffic by itself in a moment; the claim
  keeps it out for the whole reload. It takes a slot of the rollout's own budget, not of the
  fleet's: it is unavailable already, so taking it adds no unavailable pod now.
* **Ready**: the claim takes one more unit out of traffic: a slot of both budgets.

The two budgets are Deployment's: the rollout keeps at most ``maxUnavailable`` units out of
traffic itself (a Deployment's new ReplicaSet may have at most that many unavailable pods, and
it cleans up already-unhealthy old pods only within it), and it takes a Ready unit out only
while fewer than ``maxUnavailable`` units are unavailable for any reason (``minAvailable``
counts every unavailable pod). Claiming NotReady units for free, as the planner once did, let a
readiness blip on 3 of 4 pods keep 3 of 4 out of traffic for a whole reload with
``maxUnavailable: 1`` (issue 27 item 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from weightroll_operator.domain.fleet import Unit
from weightroll_operator.domain.model import AgentView

__all__ = ["Slots", "held_by_agent", "held_by_gate"]


def held_by_gate(unit: Unit) -> bool:
    """Every pod of ``unit`` is out of traffic by our gate (so a claim keeps nothing out that
    would serve)."""
    return unit.gated_out


def held_by_agent(unit: Unit, agents: Mapping[str, AgentView]) -> bool:
    """Every pod of ``unit`` is held out of traffic by its agent until an update (module doc).
    An agent that does not answer, whose ranks are not up (booting), that runs an update or is
    ready holds nothing: the pod may come back by itself."""
    return all(_holds(agents.get(p.name)) for p in unit.pods)


def _holds(agent: AgentView | None) -> bool:
    return (
        agent is not None
        and agent.reachable
        and agent.engine_seen
        and not agent.active_update_id
        and not agent.ready
    )


@dataclass(slots=True)
class Slots:
    """The slots left this pass; :meth:`take` spends them claim by claim."""

    #: ``maxUnavailable`` minus every unavailable unit, whatever the reason (``plan.budget``).
    fleet: int
    #: ``maxUnavailable`` minus the units the rollout itself keeps out of traffic.
    rollout: int
    #: Keys of the units held out of traffic by their agents (:func:`held_by_agent`).
    agent_held: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(
        cls,
        max_unavailable: int,
        fleet: int,
        held: Iterable[Unit],
        agent_held: Iterable[str] = (),
    ) -> Slots:
        """``held``: the units out of traffic because of the rollout (in flight, failed, seen
        before our own write, or held by our gate); ``agent_held``: the keys of those held out
        by their agents."""
        return cls(
            fleet=fleet,
            rollout=max_unavailable - sum(1 for _ in held),
            agent_held=frozenset(agent_held),
        )

    def cost(self, unit: Unit) -> int:
        """0: free; 1: a rollout slot only; 2: a slot of both budgets (module doc)."""
        if held_by_gate(unit) or unit.key in self.agent_held:
            return 0
        return 2 if unit.ready else 1

    def affords(self, unit: Unit) -> bool:
        cost = self.cost(unit)
        return cost == 0 or (self.rollout > 0 and (cost == 1 or self.fleet > 0))

    def take(self, unit: Unit) -> None:
        """Spend what claiming ``unit`` costs (call only after :meth:`affords`)."""
        cost = self.cost(unit)
        if cost:
            self.rollout -= 1
        if cost == 2:
            self.fleet -= 1
