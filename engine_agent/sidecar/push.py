"""The trainer-push feeder: vLLM's native weight-transfer routes, fronted (issue 12 C), through
the replica's one commit sequence (:mod:`engine_agent.sidecar.pipeline`).

Routes (same names and bodies as vLLM's ``entrypoints/rl/online/api_router.py``, on the agent's
port, every one behind a **trainer** token: ``--trainer-token-file``, never the operator's
``--token-file``; without a trainer token file the routes are closed):
``POST /init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/shutdown_weight_transfer_engine`` and ``GET /weight_info``
(served by :mod:`engine_agent.sidecar.transfer_routes`). Each step forwards to vLLM on
loopback (:class:`~engine_agent.sidecar.engine.VllmClient`); around them the agent adds what
vLLM lacks:

* ``init``: the trainer's ``init_info`` names the peer every worker connects to, and vLLM's
  NCCL rendezvous unpickles what that peer publishes. The agent refuses (403, nothing reaches
  vLLM) unless the peer is an IP address inside ``AgentConfig.trainer_networks``
  (``--trainer-networks``; empty, the default, refuses every push), then asks every rank to
  check it too (``weightroll_transfer_check_init``: a weightroll backend, the rank's own
  trainer networks) and forwards only when all agree (:mod:`engine_agent.transfer.rendezvous`).
  ``start`` is refused while no trainer network is configured, and ``update_weights`` refuses
  pickled payloads (``ipc_handles_pickled``).
* ``start``: refuses while a file update (``/v1/updates``) or another push runs; holds the
  replica (readiness 503 until a commit), pauses generation, and arms every rank with one
  session id (``weightroll_transfer_arm``) before forwarding.
* ``finish``: names the version on every rank (``weightroll_transfer_commit_as``; the trainer's
  ``weight_version`` or the push id), forwards, then reads **every rank's own report**
  (``weightroll_transfer_report``, which never raises) and requires all-rank agreement
  (:func:`~engine_agent.sidecar.agreement.check_commit`), checks the ranks' state, resets the prefix
  cache, records the version (also in vLLM, ``/update_weight_version``), releases the hold and
  resumes (the pipeline's confirm and commit, as for a file update) — and only then answers
  200.
* any failure (a refused batch, a finish that does not verify, vLLM unreachable): the
  pipeline's fail path with the push's own session close: every rank is fenced
  (``weightroll_transfer_fence``: poisoned, vLLM's update flag cleared), generation stays
  paused, the hold stays, ``/readyz`` answers 503, and the trainer gets an HTTP error whose
  :class:`~engine_agent.protocol.ErrorBody` names what is missing or duplicated. A retried or
  empty finish afterwards is refused (409: no push open), and an empty start/finish fails
  verification (nothing received), so only a full push that commits clears the fence.
* ``/weight_info`` answers the version of the last verified commit, never a label a trainer
  set; it also carries ``world_size`` (the trainer's transfer group needs it).

* a push nobody can finish (the trainer died, or vLLM restarted underneath it) is ended by the
  agent's guard (:meth:`TransferCoordinator.watch`, the reasons in :mod:`.push_failure`), fenced
  and held like any failure.

Limitations: one push at a time per replica; pushes are not persisted (an agent restarted
mid-push finds the ranks' session open, aborts it and holds the replica, see recovery.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from engine_agent.protocol import (
    VERSION_PATTERN,
    DrainMode,
    ExtensionRpc,
    UpdateMode,
    UpdatePhase,
    UpdateSpec,
)
from engine_agent.sidecar.agent import Agent
from engine_agent.sidecar.agreement import check_commit, check_session
from engine_agent.sidecar.engine import EngineError
from engine_agent.sidecar.pipeline import Pipeline, ReplicaBusy
from engine_agent.sidecar.push_failure import (
    FENCE,
    PushFailed,
    fence_ranks,
    status_of,
    status_of_problems,
    why_dead,
)
from engine_agent.sidecar.push_rendezvous import (
    check_peer,
    check_update,
    ranks_accept,
    require_trainer_networks,
)
from engine_agent.sidecar.rounds import Problem, collect_reports

__all__ = ["FENCE", "Push", "PushFailed", "TransferCoordinator"]

logger = logging.getLogger(__name__)

ARM: Final = ExtensionRpc.TRANSFER_ARM
COMMIT_AS: Final = ExtensionRpc.TRANSFER_COMMIT_AS
REPORT: Final = ExtensionRpc.TRANSFER_REPORT

#: Bound of ``/init_weight_transfer_engine`` (the workers wait there for the trainer's group).
INIT_TIMEOUT_S: Final = 600.0
#: Seconds ``/pause?mode=wait`` may take at start before in-flight requests are aborted.
DRAIN_TIMEOUT_S: Final = 30.0

_VERSION = re.compile(VERSION_PATTERN)


@dataclass(slots=True)
class Push:
    """The push that is open on this replica."""

    id: str
    world: int
    started: float
    #: When the trainer last called a step of this push (monotonic): the idle clock.
    last_call: float = 0.0
    reports: list[dict[str, Any]] = field(default_factory=list)


class TransferCoordinator:
    """Runs pushes for one replica on behalf of the routes (one at a time).

    Args:
        agent: the replica's agent (its vLLM client, store, metrics and hold).
        wall: wall clock (Unix seconds), injected for tests.
        monotonic: duration clock, injected for tests.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.push: Push | None = None
        #: Why the last push failed (named by a later finish that finds no push open).
        self.last_failure: str | None = None
        self.last_commit_at: float | None = None
        self._wall = wall
        self._monotonic = monotonic
        #: One step at a time (the trainer calls are sequential; a second caller waits).
        self.lock = asyncio.Lock()
        self._counter = itertools.count(1)
        agent.metrics.track_commits(self._version, self._last_commit, wall)

    @property
    def pipeline(self) -> Pipeline:
        return self.agent.pipeline

    # -- metrics sources ---------------------------------------------------------------

    def _version(self) -> str | None:
        return self.agent.store.memory.expected_version

    def _last_commit(self) -> float | None:
        stamps = [
            datetime.fromisoformat(record.finished_at.replace("Z", "+00:00")).timestamp()
            for record in self.agent.store.records.values()
            if record.phase is UpdatePhase.COMMITTED and record.finished_at
        ]
        if self.last_commit_at is not None:
            stamps.append(self.last_commit_at)
        return max(stamps) if stamps else None

    # -- helpers -------------------------------------------------------------------------

    def _refuse_if_busy(self) -> None:
        busy = self.pipeline.busy_reason()
        if busy is not None:
            raise PushFailed(409, [Problem("conflict", f"{busy}; retry later")])

    def _require_push(self, what: str) -> Push:
        if self.push is None:
            after = f"; the last push failed: {self.last_failure}" if self.last_failure else ""
            raise PushFailed(
                409,
                [Problem("no_push", f"{what} without an open push (call start first){after}")],
            )
        self.push.last_call = self._monotonic()
        return self.push

    async def _ranks(self, push: Push, method: ExtensionRpc, arg: str, timeout: float) -> Any:
        results = await self.agent.client.collective_rpc(method, arg, timeout)
        round_ = collect_reports(method, results, push.world)
        push.reports = [report.to_wire() for report in round_.reports]
        return round_

    # -- steps -------------------------------------------------------------------------

    async def init(self, body: dict[str, Any]) -> Any:
        # Before anything else: a refused peer never reaches vLLM.
        init_info = check_peer(body, self.agent.config)
        self._refuse_if_busy()
        await ranks_accept(self.agent.client, self.agent.config, init_info)
        return await self._forward("/init_weight_transfer_engine", body, INIT_TIMEOUT_S)

    async def shutdown(self) -> Any:
        self._refuse_if_busy()
        return await self._forward("/shutdown_weight_transfer_engine", {}, INIT_TIMEOUT_S)

    async def _forward(self, path: str, body: Any, timeout: float) -> Any:
        try:
            return await self.agent.client.post_json(path, body, timeout)
        except EngineError as e:
            raise PushFailed(status_of(e), [Problem(e.code, str(e))]) from e

    async def start(self) -> dict[str, Any]:
        require_trainer_networks(self.agent.config)
        self._refuse_if_busy()
        if not self.agent.recovered:
            raise PushFailed(
                409,
                [Problem("conflict", "the agent has not yet recovered the engine state; retry")],
            )
        config, pipeline = self.agent.config, self.pipeline
        # Claimed before the first await: a file update (or another start) accepted while this
        # one waits would run beside the push, and its commit would resume generation while
        # the push writes.
        try:
            pipeline.claim("a trainer push is starting", self.watch)
        except ReplicaBusy as e:
            raise PushFailed(409, [Problem("conflict", str(e))]) from e
        try:
            world = await self.agent.client.world_size()
        except BaseException as e:
            pipeline.release()
            if isinstance(e, EngineError):
                raise PushFailed(status_of(e), [Problem(e.code, str(e))]) from e
            raise
        push_id = f"push-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        push = Push(push_id, world, self._monotonic(), self._monotonic())
        self.push = push
        pipeline.rename(f"trainer push {push_id} is in progress")
        pipeline.hold(Problem("push_incomplete", f"push {push_id} started and has not committed"))
        async with self._failing_closed(push):
            try:
                await pipeline.drain(DrainMode.WAIT, DRAIN_TIMEOUT_S)
            except EngineError as e:
                raise PushFailed(status_of(e), [Problem(e.code, f"pause: {e}")]) from e
            # Not accepted until every check passed: an agent restarted without its state must
            # not adopt the push's bytes (vLLM's untouched "default" marker would let it).
            await pipeline.mark_unaccepted(push_id)
            spec = UpdateSpec(update_id=push_id, version=push_id, mode=UpdateMode.FULL)
            armed = check_session(
                await self._ranks(
                    push, ARM, spec.model_dump_json(by_alias=True), config.begin_timeout
                ),
                push_id,
            )
            if not armed.ok:
                raise PushFailed(409, list(armed.problems))
            await self._step("/start_weight_update", {}, config.begin_timeout)
        logger.info("Started trainer push %s on %d rank(s)", push_id, world)
        return {"message": "Weight update started", "update_id": push_id}

    async def _step(self, path: str, body: Any, timeout: float) -> Any:
        try:
            return await self.agent.client.post_json(path, body, timeout)
        except EngineError as e:
            raise PushFailed(status_of(e), [Problem(e.code, f"{path}: {e}")]) from e

    async def update(self, body: dict[str, Any]) -> dict[str, Any]:
        push = self._require_push("update_weights")
        async with self._failing_closed(push, explain=True):
            if "update_info" not in body:  # the trainer already broadcasts: end the push
                raise PushFailed(
                    422, [Problem("invalid_request", "update_info: field required")], "update_info"
                )
            check_update(body["update_info"])
            await self._step("/update_weights", body, self.agent.config.load_timeout)
        return {"message": "Weights updated"}

    async def finish(self, body: dict[str, Any]) -> dict[str, Any]:
        push = self._require_push("finish_weight_update")
        version = body.get("weight_version") or push.id
        config = self.agent.config
        # Inside the fail-closed step: a refused finish ends the push like any failure (fenced,
        # held, released), so the trainer's next start is not refused as "push in progress"
        # until the idle timeout (issue 26, 9).
        async with self._failing_closed(push):
            if not isinstance(version, str) or not _VERSION.match(version):
                raise PushFailed(
                    422,
                    [
                        Problem(
                            "invalid_request",
                            f"weight_version {version!r} must match {VERSION_PATTERN} (it "
                            "becomes a label value)",
                        )
                    ],
                    "weight_version",
                )
            named = check_session(
                await self._ranks(
                    push, COMMIT_AS, json.dumps({"version": version}), config.control_timeout
                ),
                push.id,
            )
            if not named.ok:
                raise PushFailed(409, list(named.problems))
            problems: list[Problem] = []
            try:
                await self.agent.client.post_json(
                    "/finish_weight_update", {}, config.finish_timeout
                )
            except EngineError as e:
                problems.append(Problem(e.code, f"/finish_weight_update: {e}"))
            reports = check_commit(
                await self._ranks(push, REPORT, "{}", config.control_timeout), push.id, version
            )
            problems = [*reports.problems, *problems]
            if problems:
                raise PushFailed(status_of_problems(problems), problems)
            await self._confirm(push, version)
        return {
            "message": "Weight update finished",
            "weight_version": version,
            "update_id": push.id,
            "ranks": push.reports,
        }

    async def _confirm(self, push: Push, version: str) -> None:
        """After every rank committed: the pipeline's confirmation and commit, then release."""
        problems = await self.pipeline.confirm(push.world, push.id, version)
        if problems:
            raise PushFailed(409, problems)
        # The push's id, not the last file update's: an operator attempt that committed this
        # version earlier must not vouch for the trainer's bytes. No source: a delta may not
        # build on a push (AgentMemory.delta_refusal).
        await self.pipeline.commit(version, push.id, None)
        self._release(push)
        self.last_failure = None
        self.last_commit_at = self._wall()
        self.agent.metrics.pushes.labels(outcome="committed").inc()
        self.agent.metrics.phase_duration.labels(phase="finish").observe(
            self._monotonic() - push.started
        )
        logger.info("Committed trainer push %s as version %s", push.id, version)

    @contextlib.asynccontextmanager
    async def _failing_closed(self, push: Push, *, explain: bool = False) -> AsyncIterator[None]:
        """Run one step of ``push``; whatever way it fails, the push ends fenced and held.

        ``explain`` adds every rank's own reason to the error (a refused batch)."""
        try:
            yield
        except PushFailed as e:
            if explain:
                await self._explain(push, e)
            await self._fail(push, e)
            raise
        except EngineError as e:
            failed = PushFailed(status_of(e), [Problem(e.code, str(e))])
            await self._fail(push, failed)
            raise failed from e
        except Exception as e:  # a defect or an unexpected answer: still fail closed
            logger.exception("Trainer push %s step failed unexpectedly", push.id)
            failed = PushFailed(500, [Problem("internal_error", f"{type(e).__name__}: {e}")])
            await self._fail(push, failed)
            raise failed from e
        except BaseException:
            # Cancelled (the agent is stopping): nothing more can be awaited. The hold saved
            # at start stays, so the replica stays out of traffic; the push no longer blocks.
            self._release(push)
            raise
        finally:
            push.last_call = self._monotonic()

    def _release(self, push: Push) -> None:
        if self.push is push:
            self.push = None
            self.pipeline.release()
        self.agent.forget_observation()

    async def watch(self) -> None:
        """End the open push when nobody can finish it any more (the agent's guard calls this).

        A trainer whose transport broke (a peer died mid-broadcast) or that crashed between
        steps never calls finish; a vLLM restarted under the push dropped the ranks' session.
        Either way the push would hold the replica and refuse every later update for ever.
        A step in flight is left alone: it ends the push itself."""
        push = self.push
        if push is None or self.lock.locked():
            return
        async with self.lock:  # judged under the lock: a step arriving now waits for the verdict
            if self.push is not push:
                return
            idle = self._monotonic() - push.last_call
            problem = await why_dead(
                self.agent.client, self.agent.config, push.id, push.world, idle
            )
            if problem is not None:
                await self._fail(push, PushFailed(409, [problem]))

    async def _explain(self, push: Push, failed: PushFailed) -> None:
        """Add every rank's own reason to a failed step (vLLM's 500 names only the first)."""
        with contextlib.suppress(EngineError):
            round_ = await self._ranks(push, REPORT, "{}", self.agent.config.control_timeout)
            # The ranks' own reasons first: they name the shard; vLLM's 500 only says it failed.
            failed.problems[:0] = round_.problems

    async def _fail(self, push: Push, failed: PushFailed) -> None:
        """Fence every rank, keep generation paused and the replica held; record the cause."""
        client, config = self.agent.client, self.agent.config
        reason = f"push {push.id} did not commit: {failed.problems[0]}"

        async def fence(_: Problem) -> list[Problem]:
            try:
                return await fence_ranks(client, config.control_timeout, push.world, reason)
            finally:
                # Released even when the fence did not reach every rank: a push that cannot
                # be ended cleanly still never blocks the next one (the hold keeps it out).
                self._release(push)

        await self.pipeline.fail(f"push {push.id}", failed.problems, fence)
        self.last_failure = "; ".join(map(str, failed.problems))[:2000]
        self.agent.metrics.pushes.labels(outcome="failed").inc()
        logger.warning("Trainer push %s failed; replica fenced and held: %s", push.id, reason)

    async def weight_info(self) -> dict[str, Any]:
        world: int | None = None
        with contextlib.suppress(EngineError):
            world = await self.agent.client.world_size()
        return {"weight_version": self.agent.store.memory.expected_version, "world_size": world}
