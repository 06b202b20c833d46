"""The agent: one replica, its two feeders and the fail-closed guard around them.

Weights reach the replica two ways, both through its one commit sequence
(:mod:`engine_agent.sidecar.pipeline`): a file update the operator asks for
(``POST /v1/updates``, :mod:`engine_agent.sidecar.file_update`) and a trainer push through
vLLM's native routes (:mod:`engine_agent.sidecar.push`). The agent admits them one at a time,
answers readiness and state from what the ranks report, and guards the replica between them.

Invariants:
    * **Accepted means held.** From the moment an update is accepted the replica holds a *hold*
      (a reason to stay paused) that only a committed update clears. Every failure, abort,
      timeout or crash therefore ends with generation paused and ``/readyz`` 503, and the verdict
      (or ``/v1/state`` message) names the cause. The hold is persisted when a state directory
      is configured, so it survives an agent restart.
    * **The guard re-asserts the hold.** A background loop observes the ranks; if vLLM was
      restarted underneath the agent (ranks at another version, session gone, unpaused while
      held) it pauses generation again and records why.
    * **Accepted is recorded outside the agent.** An agent restarted without its state file
      adopts the ranks' version only when vLLM's weight version names it (or is vLLM's boot
      value ``default``: no agent ever touched this engine); the pipeline keeps it
      ``weightroll-unaccepted:<id>`` until a commit.
    * **Partial and sparse build only on what was accepted.** They are refused (409) unless the
      agent holds an accepted version and no hold, and their ``baseVersion`` must be it.

Time is injected (``now`` for timestamps, ``monotonic`` for durations and the swap deadline,
``sleep`` for its wake-up) for tests and the simulation tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from engine_agent.protocol import (
    AgentState,
    DrainMode,
    EngineState,
    UpdatePhase,
    UpdateRequest,
)
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.confinement import SourceRefused
from engine_agent.sidecar.engine import EngineError, VllmClient
from engine_agent.sidecar.file_update import FileUpdate
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.observation import RankObserver, commit_on_ranks
from engine_agent.sidecar.observation import faults as observation_faults
from engine_agent.sidecar.pipeline import Pipeline
from engine_agent.sidecar.recovery import recover
from engine_agent.sidecar.rounds import Problem
from engine_agent.sidecar.state import Store, UpdateRecord
from engine_agent.sidecar.swap import swap_refusal
from engine_agent.sidecar.verdict import finish_record

__all__ = ["Agent", "Readiness", "SourceRefused", "UpdateConflict", "UpdateNotFound"]

logger = logging.getLogger(__name__)

#: Phases of an update in which the replica still serves (a prefetch before its drain).
_SERVING_PHASES: Final = (UpdatePhase.PREFETCHING, UpdatePhase.PREFETCHED)


class UpdateConflict(Exception):
    """Another update is active, or the id was used with a different request (HTTP 409)."""

    def __init__(self, message: str, active_id: str | None = None) -> None:
        super().__init__(message)
        self.active_id = active_id


class UpdateNotFound(KeyError):
    """No update with this id (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reasons: tuple[str, ...] = ()


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Agent:
    """Owns one replica: accepts updates, runs them, answers state and readiness."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        client: VllmClient | None = None,
        metrics: AgentMetrics | None = None,
        now: Callable[[], datetime] = _utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.client = client or VllmClient(config.vllm_url)
        self.metrics = metrics or AgentMetrics()
        self._now = now
        self._monotonic = monotonic
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None
        #: The file update ``_task`` runs (its swap is given through it).
        self._update: FileUpdate | None = None
        self._guard: asyncio.Task[None] | None = None
        self._recovered = asyncio.Event()
        #: An update was interrupted while its ranks prefetched: free their staging at recovery.
        self._stale_prefetch = False
        #: The replica as its ranks last reported it (readiness, state and the guard read it).
        self.observer = RankObserver(config, self.client, self.metrics, monotonic)
        self._message = ""
        self._stopping = False
        #: The replica's one commit sequence, shared with the trainer-push feeder (push.py).
        self.pipeline = Pipeline(
            config, self.client, Store(config.state_dir), self.metrics, self.forget_observation
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load persisted memory and start the recovery + guard loop (returns at once)."""
        if self.store.load():
            logger.info("Loaded agent state from %s", self.config.state_dir)
        memory = self.store.memory
        if memory.expected_version is None and self.config.initial_version is not None:
            memory.expected_version = self.config.initial_version
        if memory.source is None:
            memory.source = self.config.initial_source
        interrupted = self.store.active
        if interrupted is not None and not interrupted.phase.terminal:
            # A prefetch before its hold wrote nothing and paused nothing: its staging is freed
            # once vLLM answers (recovery.recover) and the replica serves on; anything later is
            # held.
            serving = interrupted.phase in _SERVING_PHASES and memory.hold is None
            problem = Problem(
                "agent_restarted",
                f"the agent restarted during phase {interrupted.phase.value}; "
                + (
                    "the ranks' prefetched staging is freed and the replica serves on"
                    if serving
                    else "the session was aborted on every rank and generation stays paused"
                ),
            )
            finish_record(
                self.store, self.metrics, interrupted, UpdatePhase.FAILED, [problem], self._stamp()
            )
            if serving:
                self._stale_prefetch = True
            else:
                self._set_hold(problem)
        self.store.active_id = None
        self.store.save()
        self._guard = asyncio.create_task(self._guard_loop(), name="weightroll-agent-guard")

    async def stop(self) -> None:
        """Stop the guard and any running update (which ends Aborted, replica held)."""
        self._stopping = True
        for task in (self._task, self._guard):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.client.close()

    def forget_observation(self) -> None:
        """Drop the cached observation (another path just changed what the ranks serve)."""
        self.observer.forget()

    @property
    def store(self) -> Store:
        """The replica's records and memory: the pipeline's, so there is only one."""
        return self.pipeline.store

    @store.setter
    def store(self, store: Store) -> None:  # an agent restarted with its state (tests)
        self.pipeline.store = store

    @property
    def recovered(self) -> bool:
        return self._recovered.is_set()

    # ------------------------------------------------------------------ API used by app.py

    def submit(self, request: UpdateRequest) -> tuple[bool, UpdateRecord]:
        """Accept ``request`` (idempotent by id).

        Returns:
            ``(created, record)``: ``created`` is False when the same request was seen before.

        Raises:
            SourceRefused: the source or manifest lies outside the model directory.
            UpdateConflict: another update is active, or the id was used for another request.
        """
        self.config.check_source(request.source)  # before anything is read
        existing = self.store.records.get(request.id)
        if existing is not None:
            if existing.request != request:
                raise UpdateConflict(
                    f"update id {request.id!r} was already used for a different request",
                    self.store.active_id,
                )
            return False, existing
        refusal = self._refusal(request)
        if refusal is not None:
            raise UpdateConflict(refusal, self.store.active_id)
        # Claimed before anything awaits: a push (or another update) is refused from here on.
        self.pipeline.claim(f"update {request.id} is in progress")
        record = UpdateRecord(request=request, started_at=self._stamp())
        self.store.add(record)
        self.store.active_id = record.id
        self.store.save()
        logger.info("Accepted update %s to version %s", record.id, request.version)
        update = FileUpdate(
            self.pipeline,
            record,
            now=self._now,
            monotonic=self._monotonic,
            sleep=self._sleep,
            stopping=lambda: self._stopping,
        )
        self._update = update
        self._task = asyncio.create_task(update.run(), name=f"weightroll-update-{record.id}")
        # A task cancelled before its first step never runs its own cleanup: end it here.
        self._task.add_done_callback(lambda _: self._ended_unrun(update))
        return True, record

    def _ended_unrun(self, update: FileUpdate) -> None:
        record = update.record
        if update.started or record.phase.terminal:
            return
        problem = Problem("aborted", "update aborted by request before it started")
        finish_record(
            self.store, self.metrics, record, UpdatePhase.ABORTED, [problem], self._stamp()
        )
        self.pipeline.release()

    def _refusal(self, request: UpdateRequest) -> str | None:
        """Why ``request`` may not start now (None: it may)."""
        busy = self.pipeline.busy_reason()
        if busy is not None:
            return f"{busy}; retry later"
        if not self.recovered:
            return "the agent has not yet recovered the engine state; retry"
        return self.store.memory.delta_refusal(request)

    def get(self, update_id: str) -> UpdateRecord:
        record = self.store.records.get(update_id)
        if record is None:
            raise UpdateNotFound(update_id)
        return record

    async def abort(self, update_id: str) -> UpdateRecord:
        """Abort update ``update_id`` if it still runs; the replica stays paused.

        Raises:
            UpdateNotFound: unknown id.
            UpdateConflict: the update already committed.
        """
        record = self.get(update_id)
        if record.phase is UpdatePhase.COMMITTED:
            raise UpdateConflict(f"update {update_id!r} already committed; roll back instead")
        if record.phase.terminal:
            return record
        task = self._task
        if task is not None and not task.done() and self.store.active_id == update_id:
            record.message = "abort requested"
            task.cancel()
            # Cleanup (weightroll_abort on every rank) queues behind a running rank call in
            # vLLM, which can take minutes: wait briefly, then answer; callers poll the status.
            await asyncio.wait([task], timeout=self.config.abort_wait)
        return record

    def swap(self, update_id: str) -> UpdateRecord:
        """Give the go to ``update_id``, parked in ``Prefetched`` (idempotent once given).

        Raises:
            UpdateNotFound: unknown id.
            UpdateConflict: it does not await a swap, or is not (or no longer) swappable.
        """
        record = self.get(update_id)
        refusal = swap_refusal(record)
        if refusal is not None:
            raise UpdateConflict(refusal, self.store.active_id)
        if self._update is not None and self._update.record is record:
            self._update.swap()
        return record

    async def readiness(self) -> Readiness:
        """Fail-closed readiness: every rank committed at the expected version, not paused."""
        ready, reasons = await self._readiness()
        self.metrics.ready.set(1 if ready else 0)
        return Readiness(ready, tuple(reasons))

    async def state(self) -> AgentState:
        """Render ``GET /v1/state`` (observes the ranks unless an update runs)."""
        ready, reasons = await self._readiness()
        observation = self.observer.last
        memory = self.store.memory
        paused = bool(observation and observation.paused)
        if self.store.active is not None:
            paused = self.store.active.phase not in (UpdatePhase.PENDING, *_SERVING_PHASES)
        # What the ranks serve now (one version on every rank), never the agent's record alone:
        # a vLLM restarted under a committed agent serves its boot weights again.
        live = {r.version for r in self.observer.ranks}
        reachable = observation is None or observation.reachable or self._updating()
        version = next(iter(live)) if len(live) == 1 and reachable else ""
        # The label alone is not the commit: a vLLM restarted onto boot weights labelled like
        # the last commit reports that label too, but no longer the commit's id on its ranks.
        at_commit = (
            version != ""
            and version == memory.expected_version
            and commit_on_ranks(memory, self.observer.ranks)
        )
        clean = self.observer.state is EngineState.CLEAN
        serves_commit = not self._updating() and at_commit and clean
        message = "; ".join(reasons) if not ready else self._message
        return AgentState(
            version=version,
            # Unknown (vLLM never reached) is reported as poisoned: not safe to serve.
            engine_state=self.observer.state or EngineState.POISONED,
            ready=ready,
            paused=paused,
            active_update_id=self.store.active_id,
            # none when vLLM cannot be asked (booting, down): the last ones would be stale,
            # and an empty list is how a caller tells a booting engine from disagreeing ranks
            ranks=list(self.observer.ranks) if reachable else [],
            # where the weights the ranks serve came from (unknown after a restart under us
            # unless they are the boot weights)
            source=memory.source
            if at_commit
            else self.config.initial_source
            if version and version == self.config.initial_version
            else None,
            message=message,
            committed_version=memory.expected_version,
            committed_update_id=memory.committed_update_id if serves_commit else None,
        )

    # ------------------------------------------------------------------ observation & guard

    async def _readiness(self) -> tuple[bool, list[str]]:
        if self._updating():
            return False, [self._in_progress()]
        held = [] if self.store.memory.hold is None else [f"held: {self.store.memory.hold}"]
        if not self.recovered:
            return False, [*held, "the agent has not yet recovered the engine state"]
        observation = await self.observer.observe()
        if self._updating():  # an update started while we observed
            return False, [self._in_progress()]
        if not observation.reachable:
            return False, [*held, *(str(problem) for problem in observation.problems)]
        faults = observation_faults(observation, self.store.memory)
        if faults and self.store.memory.hold is None:
            self._set_hold(faults[0])
            self.store.save()
        hold = self.store.memory.hold
        reasons = [] if hold is None else [f"held: {hold}"]
        reasons.extend(str(fault) for fault in faults if str(fault) != hold)
        if observation.paused:
            reasons.append("generation is paused")
        return not reasons, reasons

    def _in_progress(self) -> str:
        return self.pipeline.busy_reason() or "an update is in progress"

    async def _guard_loop(self) -> None:
        await recover(
            self.observer,
            self.store,
            free_staging=self._stale_prefetch,
            set_hold=self._set_hold,
            say=self._say,
        )
        self._recovered.set()
        while True:
            try:
                await self._guard_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the guard must never die
                logger.exception("Guard pass failed")
            await asyncio.sleep(self.config.watch_interval)

    def _updating(self) -> bool:
        """An attempt owns the replica's pause, resume and readiness now; a prefetching update
        before its hold does not: the replica serves its old weights meanwhile."""
        return self.pipeline.busy and not self._prefetching()

    def _prefetching(self) -> bool:
        active = self.store.active
        return (
            active is not None
            and active.phase in _SERVING_PHASES
            and self.store.memory.hold is None
        )

    async def _guard_once(self) -> None:
        watchdog = self.pipeline.watchdog
        if watchdog is not None:
            await watchdog()
        if self._updating():
            return
        ready, _ = await self._readiness()
        self.metrics.ready.set(1 if ready else 0)
        observation = self.observer.last
        if (
            # An update may have started while we awaited: it owns pause/resume now.
            not self._updating()
            and self.store.memory.hold is not None
            and observation is not None
            and observation.reachable
            and observation.paused is False
        ):
            logger.warning("Re-paused generation held by: %s", self.store.memory.hold)
            with contextlib.suppress(EngineError):
                await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
                self.observer.forget()

    # ------------------------------------------------------------------ the update

    def _stamp(self) -> str:
        return self._now().isoformat().replace("+00:00", "Z")

    def _say(self, message: str) -> None:
        self._message = message

    def _set_hold(self, problem: Problem) -> None:
        self.store.memory.hold = str(problem)
        self.store.memory.hold_code = problem.code
