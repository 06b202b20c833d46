"""The one verified commit of a replica, which both feeders run.

Two feeders bring weights: a file update from the operator (``POST /v1/updates``,
:mod:`engine_agent.sidecar.file_update`) and a trainer push through vLLM's native routes
(:mod:`engine_agent.sidecar.push`). They differ in how the ranks' session is opened, written
and closed; everything around that is here, once::

    claim ─ hold ─ drain ─ mark unaccepted ─ [feeder writes] ─ all-rank agreement ─
    confirm (state, prefix cache, feeder checks) ─ commit ─ resume

* **One owner.** :meth:`Pipeline.claim` admits one attempt at a time, whichever feeder it comes
  from; a second is refused with :class:`ReplicaBusy` (HTTP 409) naming the first.
* **Accepted means held.** :meth:`Pipeline.hold` saves a reason to stay paused before the
  first write; only :meth:`Pipeline.commit` clears it, and only :meth:`Pipeline.commit` resumes
  generation.
* **Failure closes the session and keeps generation paused.** :meth:`Pipeline.fail` saves the
  cause as the hold, runs the feeder's own session close on every rank (abort or fence; it
  must not raise), pauses generation if it is not paused, and counts the failure.
* **Accepted is recorded outside the agent.** :meth:`Pipeline.mark_unaccepted` sets vLLM's
  weight version to ``weightroll-unaccepted:<id>`` before anything is written, and only
  :meth:`Pipeline.commit` names the version, so an agent restarted without its state never
  adopts an attempt that did not verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

from engine_agent.protocol import DrainMode, ExtensionRpc, SourceSpec
from engine_agent.sidecar.agreement import committed_problems
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineError, EngineTimeout, VllmClient
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.rounds import Problem, collect_states
from engine_agent.sidecar.state import Store

__all__ = ["UNACCEPTED_PREFIX", "Pipeline", "ReplicaBusy"]

logger = logging.getLogger(__name__)

#: vLLM's weight version while an attempt has not been accepted (``/update_weight_version``).
UNACCEPTED_PREFIX: Final = "weightroll-unaccepted:"
#: Attempts at the prefix-cache reset after a commit (vLLM refuses it while a request runs).
CACHE_RESET_ATTEMPTS: Final = 3

#: Closes the attempt's session on every rank after a failure; gets the first problem and
#: returns what went wrong closing it (never raises).
SessionClose = Callable[[Problem], Awaitable[list[Problem]]]


class ReplicaBusy(Exception):
    """Another attempt owns the replica (HTTP 409); the message names it."""


class Pipeline:
    """The commit sequence of one replica, shared by its feeders (module doc).

    Args:
        config: the agent's tunables (timeouts).
        client: the local vLLM server.
        store: the persisted memory (hold, version, source, commit id).
        metrics: the agent's metric families.
        forget_observation: drops the agent's cached view of the ranks (after anything that
            changes what they serve).
    """

    def __init__(
        self,
        config: AgentConfig,
        client: VllmClient,
        store: Store,
        metrics: AgentMetrics,
        forget_observation: Callable[[], None],
    ) -> None:
        self.config = config
        self.client = client
        self.store = store
        self.metrics = metrics
        self._forget = forget_observation
        #: What owns the replica now (``None``: nothing), in words for refusals and readiness.
        self.owner: str | None = None
        #: Called by the agent's guard while the owner runs between calls (a trainer push):
        #: it ends the attempt when nobody can finish it any more.
        self.watchdog: Callable[[], Awaitable[None]] | None = None

    # -- ownership ---------------------------------------------------------------------

    def busy_reason(self) -> str | None:
        """What owns the replica now, in words (``None``: nothing)."""
        active = self.store.active
        if active is not None and not active.phase.terminal:
            return f"update {active.id} in progress (phase {active.phase.value})"
        return self.owner

    @property
    def busy(self) -> bool:
        return self.busy_reason() is not None

    def claim(self, owner: str, watchdog: Callable[[], Awaitable[None]] | None = None) -> None:
        """Own the replica for one attempt; synchronous, so nothing else is admitted before
        the caller's first await.

        Raises:
            ReplicaBusy: another attempt owns it.
        """
        reason = self.busy_reason()
        if reason is not None:
            raise ReplicaBusy(f"{reason}; retry later")
        self.owner, self.watchdog = owner, watchdog

    def rename(self, owner: str) -> None:
        """Say more about the attempt that owns the replica (e.g. once it has an id)."""
        if self.owner is not None:
            self.owner = owner

    def release(self) -> None:
        self.owner, self.watchdog = None, None
        self._forget()

    # -- the sequence --------------------------------------------------------------------

    def hold(self, problem: Problem) -> None:
        """Keep the replica out of traffic for ``problem`` until a commit (saved at once)."""
        memory = self.store.memory
        memory.hold, memory.hold_code = str(problem), problem.code
        self.store.save()

    async def drain(self, mode: DrainMode, timeout: float) -> str:
        """Pause generation: wait up to ``timeout`` s for requests in flight (``mode`` wait),
        then abort the rest. Returns how it drained, in words."""
        if mode is DrainMode.WAIT and timeout > 0:
            try:
                await self.client.pause(DrainMode.WAIT, timeout)
                return "wait"
            except EngineTimeout:
                logger.warning("Drain did not finish in %ss; aborting the requests left", timeout)
                await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
                return "abort after timeout"
        await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
        return "abort"

    async def mark_unaccepted(self, attempt_id: str) -> None:
        await self.client.set_weight_version(UNACCEPTED_PREFIX + attempt_id)

    async def confirm(
        self,
        world: int,
        attempt_id: str,
        version: str,
        checks: Iterable[Callable[[], Awaitable[list[Problem]]]] = (),
    ) -> list[Problem]:
        """After every rank reported its commit: every rank's state names this attempt at
        ``version``, the prefix cache (built from the old weights) is reset, and each of the
        feeder's ``checks`` passes. Returns the problems (empty: ready to commit)."""
        after = collect_states(
            await self.client.collective_rpc(ExtensionRpc.STATE, "{}", self.config.control_timeout),
            world,
        )
        problems = committed_problems(after, attempt_id, version)
        if not problems and not await self._reset_prefix_cache():
            problems.append(Problem("cache_reset_failed", "vLLM refused to reset the prefix cache"))
        for check in checks:
            if problems:
                break
            problems += await check()
        return problems

    async def commit(self, version: str, attempt_id: str, source: SourceSpec | None) -> None:
        """Name the version in vLLM, record the commit (clears the hold), resume generation."""
        await self.client.set_weight_version(version)
        self.store.memory.commit(version, attempt_id, source)
        self.store.save()
        self._forget()
        await self.client.resume()

    async def fail(self, attempt: str, problems: list[Problem], close: SessionClose) -> None:
        """End a failed ``attempt`` closed (module doc); ``problems`` gains what closing it
        found. Never raises for the close or the pause: the hold is saved first."""
        first = problems[0] if problems else Problem("failed", "update failed")
        try:
            self.hold(Problem(first.code, f"{attempt} did not commit: {first.message}"))
        finally:
            try:
                problems += await close(first)
            finally:
                await self.keep_paused()
        for problem in problems:
            self.metrics.verification_failures.labels(reason=problem.code).inc()

    async def keep_paused(self) -> None:
        """Pause generation if it runs (best effort: a vLLM that cannot answer serves nothing,
        and the guard pauses it again once it answers while held)."""
        with contextlib.suppress(EngineError):
            if not await self.client.is_paused():
                await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)

    async def _reset_prefix_cache(self) -> bool:
        for attempt in range(CACHE_RESET_ATTEMPTS):
            if await self.client.reset_prefix_cache():
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        return False
