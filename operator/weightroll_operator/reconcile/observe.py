"""What the agents say: one observation per pod, cached answers, backoff and tokens.

A ``/v1/state`` answer is reused for an unchanged pod (same incarnation, our same view of it)
while it is fresh: at most ``state_ttl`` seconds, each answer expiring at a random time in the
second half, so the answers of one pass do not all expire in one later pass. Only pods in
traffic are answered from the cache: a fresh answer is needed to put a pod into traffic
(restore, a joining pod), and a claim resting on a cached one is asked again before it is
applied (``confirm.py``). An agent that does not answer is backed off exponentially, with
jitter; its last failure stands until the retry. Agent tokens are read from their Secret once per
pass (``token_ttl`` 0) or reused for ``token_ttl`` seconds.

Limitations: the caches are keyed per pod (namespace, name) and emptied wholesale at
``cache_limit`` entries (pods that vanished leave theirs behind until then).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from engine_agent.protocol import EngineState, UpdatePhase
from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.apply import bounded_map, target_of
from weightroll_operator.domain.fleet import AGENT_PORT_NAME
from weightroll_operator.domain.model import AgentView, PodView, SourceRef, UpdateView
from weightroll_operator.domain.plan import Query
from weightroll_operator.errors import AgentError
from weightroll_operator.ports import AgentPort, KubePort

__all__ = ["AgentObserver", "backoff_delay"]

#: Entries of the agent-failure table before it is emptied.
_FAILURES_LIMIT = 100_000


def backoff_delay(
    failures: int, base: float, cap: float, rand: Callable[[], float] = random.random
) -> float:
    """Exponential backoff with jitter: ``base * 2**(failures-1)``, capped, times 0.5-1.5.

    The jitter spreads retries of many pods (or WeightUpdates) failing together.
    """
    exp = base * (2 ** max(0, min(failures - 1, 30)))
    return float(min(cap, exp) * (0.5 + rand()))


@dataclass
class AgentObserver:
    """Asks agents (through ``agents``) and reads their tokens (through ``kube``).

    Args:
        state_ttl: seconds an agent ``/v1/state`` answer is reused for an unchanged pod (at
            most; each answer expires at a random time in the second half).
        token_ttl: seconds an agent token read from its Secret is reused; 0 (the default): read
            once per pass, so a Secret that loses its opt-in label (or its token) is not sent
            from the next pass on.
    """

    agents: AgentPort
    #: Reads the token Secrets (``read_agent_token``).
    kube: KubePort
    concurrency: int = 32
    state_ttl: float = 30.0
    token_ttl: float = 0.0
    #: Backoff of an agent that did not answer: first retry after about this many seconds.
    agent_backoff: float = 1.0
    agent_backoff_cap: float = 60.0
    rand: Callable[[], float] = random.random
    #: Monotonic seconds for caches, TTLs and backoff (injected by the simulation tier).
    monotonic: Callable[[], float] = time.monotonic
    #: Entries of each per-pod cache before it is emptied.
    cache_limit: int = 100_000
    #: (namespace, Secret, key) -> (token, monotonic expiry).
    _tokens: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)
    #: Per pod (namespace, name): the :func:`_state_key` the answer is valid for, the answer,
    #: its expiry and the view it was got for (a key equal by identity needs no comparison).
    _states: dict[tuple[str, str], tuple[tuple[str, ...], AgentView, float, PodView]] = field(
        default_factory=dict
    )
    #: The views of the last :meth:`observe` call and those views by pod name.
    _by_name: tuple[tuple[PodView, ...], dict[str, PodView]] | None = None
    #: Per pod (namespace, name): the last view :func:`_state_key` was computed for, and the key.
    _state_keys: dict[tuple[str, str], tuple[PodView, tuple[str, ...]]] = field(
        default_factory=dict
    )
    #: (namespace, pod, incarnation) -> (consecutive agent failures, monotonic retry time, view).
    _agent_failures: dict[tuple[str, str, str], tuple[int, float, AgentView]] = field(
        default_factory=dict
    )

    async def token(self, namespace: str, spec: WeightUpdateSpec) -> str | None:
        """The token ``spec`` names (None: no Secret named).

        Raises:
            KubeError: the Secret could not be read.
            InvalidSpec: the Secret does not opt in (its label is checked on read).
        """
        ref = spec.agent.token_secret_ref
        if ref is None:
            return None
        key = (namespace, ref.name, ref.key)
        cached = self._tokens.get(key)
        if cached is not None and cached[1] > self.monotonic():
            return cached[0]
        value = await self.kube.read_agent_token(namespace, ref.name, ref.key)
        self._tokens[key] = (value, self.monotonic() + self.token_ttl)
        return value

    async def observe(
        self,
        views: tuple[PodView, ...],
        asked: Mapping[str, Query],
        token: str | None,
        cached: set[str] | None = None,
        *,
        fresh_only: bool = False,
    ) -> dict[str, AgentView]:
        """Ask each pod's agent what ``asked`` names; the names answered from the cache (an
        earlier pass's answer) are added to ``cached``; ``fresh_only`` asks every one anew."""
        if self._by_name is None or self._by_name[0] is not views:
            self._by_name = (views, {v.name: v for v in views})
        by_name = self._by_name[1]
        now = self.monotonic()
        seen: dict[str, AgentView] = {}
        todo: list[tuple[PodView, Query]] = []
        failures, states = self._agent_failures, self._states
        for name, query in asked.items():
            pod = by_name[name]
            failing = failures.get(_agent_key(pod)) if failures else None
            if failing is not None and failing[1] > now:
                seen[name] = failing[2]  # backing off: the last failure stands until then
                continue
            # Only a fresh answer may put a pod into traffic (restore, a joining pod): a cached
            # one serves pods in traffic only, whose agents' own readiness probes still guard.
            cacheable = query.update_id is None and pod.gate is True and not fresh_only
            hit = states.get((pod.namespace, pod.name)) if cacheable else None
            if hit is not None and hit[2] > now and (hit[3] is pod or self._same_key(hit[0], pod)):
                seen[name] = hit[1]
                if cached is not None:
                    cached.add(name)
            else:
                todo.append((pod, query))

        async def one(item: tuple[PodView, Query]) -> tuple[str, AgentView]:
            pod, query = item
            view = await self.ask(pod, query, token)
            self._note_agent(pod, view)
            return pod.name, view

        seen.update(await bounded_map(one, todo, self.concurrency))
        return seen

    async def ask_all(
        self, asked: Iterable[tuple[PodView, Query]], token: str | None, *, full: bool = False
    ) -> dict[str, AgentView]:
        """:meth:`ask` each pod its query, ``concurrency`` at once, with no cache and no
        backoff (the release on deletion asks every remaining pod)."""

        async def one(item: tuple[PodView, Query]) -> tuple[str, AgentView]:
            pod, query = item
            return pod.name, await self.ask(pod, query, token, full=full)

        return dict(await bounded_map(one, list(asked), self.concurrency))

    def _same_key(self, key: tuple[str, ...], pod: PodView) -> bool:
        """``key == _state_key(pod)``, computed once per view object (views of unchanged pod
        objects are reused from pass to pass; ``selection.py``)."""
        slot = (pod.namespace, pod.name)
        known = self._state_keys.get(slot)
        if known is None or known[0] is not pod:
            if known is None and len(self._state_keys) >= self.cache_limit:
                self._state_keys.clear()
            known = (pod, _state_key(pod))
            self._state_keys[slot] = known
        return known[1] == key

    def _note_agent(self, pod: PodView, view: AgentView) -> None:
        """Back off exponentially (with jitter) from an agent that did not answer."""
        key = _agent_key(pod)
        if view.reachable or pod.ip is None:
            self._agent_failures.pop(key, None)
            return
        count = self._agent_failures.get(key, (0, 0.0, view))[0] + 1
        delay = backoff_delay(count, self.agent_backoff, self.agent_backoff_cap, self.rand)
        error = f"{view.error} (failed {count}x; next try in {delay:.1f}s)"
        if len(self._agent_failures) > _FAILURES_LIMIT:
            self._agent_failures.clear()
        self._agent_failures[key] = (
            count,
            self.monotonic() + delay,
            replace(view, error=error),
        )

    async def ask(
        self, pod: PodView, query: Query, token: str | None, *, full: bool = False
    ) -> AgentView:
        """One agent observation; with an update id, also the live state once it committed
        (``full``: always), since only the live state can vouch for an attempt."""
        if pod.ip is None:
            return AgentView(reachable=False, error="pod has no IP yet")
        if pod.port is None:
            missing = f"pod has no container port named {AGENT_PORT_NAME!r}"
            return AgentView(reachable=False, error=missing)
        try:
            target = target_of(pod, token)
        except AgentError as e:
            return AgentView(reachable=False, error=str(e))
        if query.update_id is not None:
            try:
                update = await self.agents.get_update(target, query.update_id)
            except AgentError as e:
                return AgentView(reachable=False, error=str(e))
            if update is None:
                # Unknown id: not started yet, or the agent restarted and lost its records;
                # its state says whether it already serves this attempt (then no second load).
                return await self.ask(pod, Query(state=True), token)
            view = UpdateView(
                id=update.id,
                phase=update.phase,
                version=update.version,
                committed=bool(update.verdict and update.verdict.committed),
                reasons=tuple(update.verdict.reasons if update.verdict else ())
                or ((update.message,) if update.message else ()),
                started_at=update.started_at,
            )
            if update.phase is not UpdatePhase.COMMITTED and not full:
                return AgentView(reachable=True, version=update.version, update=view)
            live = await self.ask(pod, Query(state=True), token)
            return replace(live, update=view)
        key = _state_key(pod)
        try:
            state = await self.agents.state(target)
        except AgentError as e:
            return AgentView(reachable=False, error=str(e))
        src = state.source
        result = AgentView(
            reachable=True,
            version=state.version,
            ready=state.ready,
            source=None
            if src is None
            else SourceRef(uri=src.uri, manifest=src.manifest, manifest_digest=src.manifest_digest),
            active_update_id=state.active_update_id,
            clean=state.engine_state is EngineState.CLEAN,
            committed_update_id=state.committed_update_id,
            engine_seen=bool(state.ranks),
        )
        slot = (pod.namespace, pod.name)
        if slot not in self._states and len(self._states) >= self.cache_limit:
            self._states.clear()
        # Expiry spread over the second half of the TTL: the answers of one pass (the first
        # asks every agent) would otherwise all expire in one later pass, which then asks
        # thousands of agents at once (at 10,000 pods, a pass twice as long).
        ttl = self.state_ttl * (0.5 + 0.5 * self.rand())
        self._states[slot] = (key, result, self.monotonic() + ttl, pod)
        return result


def _agent_key(pod: PodView) -> tuple[str, str, str]:
    return (pod.namespace, pod.name, pod.incarnation)


def _state_key(pod: PodView) -> tuple[str, ...]:
    """A cached ``/v1/state`` answer is valid while the pod, its containers and our view of it
    are unchanged (a container restart changes ``incarnation``)."""
    state = pod.state
    return (
        pod.namespace,
        pod.name,
        pod.incarnation,
        "" if state is None else f"{state.state}|{state.version}|{state.update_id}",
        str(pod.gate),
    )
