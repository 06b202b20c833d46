"""What the ranks report between updates, and what in it makes the replica untrustworthy.

The agent answers readiness, ``/v1/state`` and its guard from one observation of the replica:
vLLM's pause flag, its world size and every rank's ``weightroll_state``, asked together and
kept for ``observe_ttl`` seconds so that a burst of probes asks vLLM once
(:class:`RankObserver`). :func:`faults` turns an observation into the problems that hold the
replica until a full update commits: a rank not clean, a rank flagging that its live weights
changed after its commit, ranks at another version than the agent committed, or at its label
but not naming its commit (a vLLM restarted onto boot weights labelled like the commit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine_agent.protocol import STILL_TRUE_VIOLATED, EngineState, ExtensionRpc, RankStatus
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineError, VllmClient
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.rounds import Problem, StateRound, collect_states
from engine_agent.sidecar.state import AgentMemory

__all__ = ["Observation", "RankObserver", "commit_on_ranks", "faults"]


@dataclass(slots=True)
class Observation:
    """One look at the replica (``at``: the monotonic clock when it was asked)."""

    at: float
    reachable: bool
    paused: bool | None = None
    world_size: int | None = None
    states: StateRound | None = None
    problems: list[Problem] = field(default_factory=list)


def commit_on_ranks(memory: AgentMemory, ranks: Sequence[RankStatus]) -> bool:
    """Every rank still serves what the agent's last commit produced (``None`` on both sides:
    the boot weights). A rank naming another commit than the agent's, or none, is not."""
    committed = memory.committed_update_id
    return all(r.committed_update_id == committed for r in ranks)


def _committed_by(ranks: Sequence[RankStatus]) -> str:
    ids = sorted({r.committed_update_id or "none (boot weights)" for r in ranks})
    return ", ".join(ids)


def _still_true_violated(statuses: Sequence[RankStatus]) -> bool:
    """A rank's guard found its live weights changed after its commit (issue 26 E)."""
    return any((s.poison_reason or "").startswith(STILL_TRUE_VIOLATED) for s in statuses)


def faults(observation: Observation, memory: AgentMemory) -> list[Problem]:
    """Problems that make the replica untrustworthy until a full update commits."""
    if not observation.reachable or observation.states is None:
        return []
    problems = list(observation.problems)
    states = observation.states
    state = states.state
    if state is not None and state is not EngineState.CLEAN:
        reasons = sorted(
            {f"{s.state.value}: {s.poison_reason}" for s in states.statuses if s.poison_reason}
        )
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        code = STILL_TRUE_VIOLATED if _still_true_violated(states.statuses) else "engine_not_clean"
        problems.append(Problem(code, f"ranks report {state.value}{detail}"))
    expected = memory.expected_version
    if expected is not None and states.versions and states.versions != {expected}:
        problems.append(
            Problem(
                "engine_restarted",
                f"ranks serve version {', '.join(sorted(states.versions))} but the agent "
                f"committed {expected}; vLLM was restarted or changed underneath the agent",
            )
        )
    elif states.statuses and not commit_on_ranks(memory, states.statuses):
        problems.append(
            Problem(
                "engine_restarted",
                f"ranks serve version {expected} but not what the agent's last commit "
                f"{memory.committed_update_id} loaded (theirs: "
                f"{_committed_by(states.statuses)}); vLLM was restarted onto boot weights "
                "with the same label, or changed by a commit the agent did not record",
            )
        )
    return problems


class RankObserver:
    """Asks the replica how it stands and remembers the last answer (module doc).

    Args:
        config: the agent's tunables (``observe_ttl``, ``control_timeout``).
        client: the local vLLM server.
        metrics: the engine-state and still-true gauges, set from every observation.
        monotonic: the clock of the cache's age.
    """

    def __init__(
        self,
        config: AgentConfig,
        client: VllmClient,
        metrics: AgentMetrics,
        monotonic: Callable[[], float],
    ) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self._monotonic = monotonic
        self._lock = asyncio.Lock()
        #: The last observation (``None``: none yet, or forgotten).
        self.last: Observation | None = None
        #: The ranks of the last observation that reached vLLM (kept while it cannot be reached).
        self.ranks: list[RankStatus] = []
        #: The worst rank state of the last observation (``None``: vLLM was not reached).
        self.state: EngineState | None = None

    def forget(self) -> None:
        """Drop the cached observation (another path just changed what the ranks serve)."""
        self.last = None

    async def observe(self, *, fresh: bool = False) -> Observation:
        """The cached observation while younger than ``observe_ttl`` (``fresh``: never)."""
        async with self._lock:
            last = self.last
            if (
                not fresh
                and last is not None
                and self._monotonic() - last.at < self.config.observe_ttl
            ):
                return last
            observation = await self._observe_now()
            self.last = observation
            return observation

    async def _observe_now(self) -> Observation:
        at = self._monotonic()
        try:
            # Concurrently: under load vLLM's API server answers each call slowly.
            paused, world, results = await asyncio.gather(
                self.client.is_paused(),
                self.client.world_size(),
                self.client.collective_rpc(ExtensionRpc.STATE, "{}", self.config.control_timeout),
            )
        except EngineError as e:
            self.state = None
            self.metrics.set_engine_state(None)
            return Observation(at, False, problems=[Problem(e.code, str(e))])
        states = collect_states(results, world)
        self.ranks = list(states.statuses)
        self.state = states.state
        self.metrics.set_engine_state(states.state)
        self.metrics.still_true_violated.set(_still_true_violated(states.statuses))
        return Observation(at, True, paused, world, states, list(states.problems))
