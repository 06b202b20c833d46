"""The file-update feeder: an update the operator asked for (``POST /v1/updates``), read by every
rank from the model volume, through the replica's one commit sequence (:mod:`.pipeline`).

    Pending    world size; manifest loaded and checked (pin, signature, digest, version, base)
    Prefetching (``prefetch.mode: Host`` only) weightroll_prefetch on every rank, then
               weightroll_prefetched until every rank holds the verified checkpoint in host
               staging; the replica serves meanwhile: no hold, no drain, still Ready
    Prefetched every rank is ready; with ``prefetch.awaitSwap`` the update stops here, the
               replica serving and Ready, until ``POST /v1/updates/{id}/swap`` (or the swap
               deadline frees the staging: ``swap_deadline``); then the ranks are asked once
               more that they still hold it, the hold is saved and the drain follows
    Draining   POST /pause?mode=wait (bounded by drain.timeoutSeconds, then mode=abort)
    Loading    weightroll_begin(spec) and weightroll_load(source) on every rank
               (prefetched: weightroll_apply, which loads from the staging without a read)
    Verifying  weightroll_finish() on every rank → all-rank agreement (agreement.check_commit)
               → the pipeline's confirmation, and the manifest still the one published
    Committed  the pipeline's commit: version named, hold cleared, generation resumed

What only this feeder does:
    * **Ranks are counted, not trusted.** Every ``collective_rpc`` result list goes through
      ``rounds.collect_reports`` with the world size read before the update.
    * **Every call is bounded** (``AgentConfig`` timeouts); a late rank is a failed rank.
    * After a failure the open session is aborted on every rank (``weightroll_abort``:
      structural cleanup, never a rollback; a dirty engine becomes poisoned and needs a full
      update).
    * **The fence holds after finish.** Once ``weightroll_finish`` was sent, any rejection (a
      rank or agreement problem, a manifest re-published mid-update, a failed cache reset, a
      timeout) aborts with ``poison: true``: ranks that committed a version the agent did not
      accept are poisoned, not left clean at it.
    * **A prefetch that fails leaves the replica as it was.** Before the hold nothing was
      written and nothing was paused: the ranks' staging is freed (``weightroll_abort`` without
      poison), the update is recorded failed, and the replica serves its old weights, Ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Final

from engine_agent.manifest import Manifest
from engine_agent.protocol import (
    ExtensionRpc,
    LoadSource,
    PrefetchArgs,
    PrefetchMode,
    RankReport,
    UpdateMode,
    UpdatePhase,
)
from engine_agent.sidecar.agreement import check_commit, check_session
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineError, VllmClient
from engine_agent.sidecar.pipeline import Pipeline
from engine_agent.sidecar.rounds import Problem, RankRound, collect_reports
from engine_agent.sidecar.state import UpdateRecord
from engine_agent.sidecar.swap import prefetch_waiting
from engine_agent.sidecar.update_manifest import ManifestRefused, manifest_unchanged, preflight
from engine_agent.sidecar.verdict import abort_args, finish_record

__all__ = ["LOAD", "FileUpdate"]

logger = logging.getLogger(__name__)

BEGIN: Final = ExtensionRpc.BEGIN
LOAD: Final = ExtensionRpc.LOAD
FINISH: Final = ExtensionRpc.FINISH
PREFETCH: Final = ExtensionRpc.PREFETCH
PREFETCHED: Final = ExtensionRpc.PREFETCHED
APPLY: Final = ExtensionRpc.APPLY
#: Seconds between two questions to the ranks while they prefetch (each is one short RPC).
PREFETCH_POLL_SECONDS: Final = 0.2
ABORT: Final = ExtensionRpc.ABORT
#: Phases whose timings are also exported as the phase-duration histogram.
_TIMED_PHASES: Final = frozenset(
    {"prefetch", "drain", "begin", "load", "finish", "verify", "resume"}
)


class _Failed(Exception):
    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.problems = list(problems)


def _merge_ranks(record: UpdateRecord, reports: Sequence[RankReport]) -> None:
    by_key = {report.rank.key: report for report in record.ranks}
    for report in reports:
        by_key[report.rank.key] = report
    record.ranks = [by_key[key] for key in sorted(by_key)]


async def _first_of(*waits: Awaitable[object]) -> None:
    """Wait until one of ``waits`` is done; the others are cancelled (so is every one when
    this wait is)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class FileUpdate:
    """Runs one accepted file update to its verdict (module doc).

    Args:
        pipeline: the replica's commit sequence (claimed by the caller for this update).
        record: the accepted update; its phase, ranks, timings and verdict are written here.
        now: the wall clock for the record's stamps.
        monotonic: duration clock (timings, and the swap deadline).
        sleep: waits that many seconds of ``monotonic``'s time (the swap deadline's wake-up; a
            simulation whose clock is virtual passes one that its clock ends).
        stopping: whether the agent is stopping (a cancel then ends ``agent_stopped``, not
            ``aborted``).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        record: UpdateRecord,
        *,
        now: Callable[[], datetime],
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.pipeline = pipeline
        self.record = record
        self.config: AgentConfig = pipeline.config
        self.client: VllmClient = pipeline.client
        self._now = now
        self._monotonic = monotonic
        self._sleep = sleep
        self._stopping = stopping
        #: :meth:`run` began (a task cancelled before its first step never does).
        self.started = False
        self._finish_sent = False
        #: The hold is saved: from here a failure keeps the replica paused (today's path).
        #: A prefetched update saves it only once every rank holds the checkpoint.
        self._held = False
        #: ``weightroll_prefetch`` was sent: the ranks may hold staging to free.
        self._prefetch_sent = False
        #: The go of an update parked in ``Prefetched`` (``prefetch.awaitSwap``).
        self._swap = asyncio.Event()

    def swap(self) -> None:
        """Give the go to an update parked in ``Prefetched`` (a repeat changes nothing)."""
        self._swap.set()

    def _stamp(self) -> str:
        return self._now().isoformat().replace("+00:00", "Z")

    def _enter(self, phase: UpdatePhase) -> None:
        self.record.phase = phase
        self.pipeline.store.save()
        logger.info("Update %s entered phase %s", self.record.id, phase.value)

    async def _call_ranks(
        self, method: ExtensionRpc, arg: str, timeout: float, world: int
    ) -> RankRound:
        results = await self.client.collective_rpc(method, arg, timeout)
        round_ = collect_reports(method, results, world)
        _merge_ranks(self.record, round_.reports)
        return round_

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> None:
        """Run to the verdict; every way it can end is recorded, none raises but a cancel."""
        record = self.record
        self.started = True
        started = self._monotonic()
        try:
            await self._run()
        except asyncio.CancelledError:
            during = record.phase.value
            problem = (
                Problem("agent_stopped", f"the agent stopped during {during}")
                if self._stopping()
                else Problem("aborted", f"update aborted by request during {during}")
            )
            await asyncio.shield(self._fail([problem], UpdatePhase.ABORTED))
        except _Failed as e:
            await asyncio.shield(self._fail(e.problems, UpdatePhase.FAILED))
        except EngineError as e:
            problem = Problem(e.code, f"{record.phase.value}: {e}")
            await asyncio.shield(self._fail([problem], UpdatePhase.FAILED))
        except Exception as e:  # a bug must still fail closed
            logger.exception("Update %s crashed", record.id)
            problem = Problem("agent_error", f"{record.phase.value}: {type(e).__name__}: {e}")
            await asyncio.shield(self._fail([problem], UpdatePhase.FAILED))
        finally:
            record.timings["total"] = round(self._monotonic() - started, 6)
            self.pipeline.release()
            self.pipeline.store.save()

    async def _run(self) -> None:
        record, request, pipeline = self.record, self.record.request, self.pipeline
        step_start = self._monotonic()

        def lap(name: str) -> None:
            nonlocal step_start
            now = self._monotonic()
            record.timings[name] = round(record.timings.get(name, 0.0) + now - step_start, 6)
            if name in _TIMED_PHASES:
                pipeline.metrics.phase_duration.labels(phase=name).observe(now - step_start)
            step_start = now

        prefetch = request.prefetch.mode is PrefetchMode.HOST
        if not prefetch:
            self._hold()  # accepted means held: from here only a commit clears the hold
        world = await self.client.world_size()
        manifest, rank_pin = await self._preflight()
        lap("preflight")
        manifest_path = request.source.manifest_path
        source = LoadSource(
            path=self.config.local_path(request.source.path),
            manifest=None if manifest_path is None else self.config.local_path(manifest_path),
            manifest_digest=rank_pin,
        )
        # A delta names the commit it builds on; each rank refuses it unless it serves exactly
        # that one (a restart since the agent last looked is caught there).
        base = pipeline.store.memory.committed_update_id
        spec = request.engine_spec(base)
        if prefetch:
            await self._prefetch(
                PrefetchArgs(spec=spec, source=source, max_bytes=request.prefetch.max_bytes), world
            )
            lap("prefetch")
            if request.prefetch.await_swap:
                await self._await_swap(world)
                lap("parked")
            self._hold()

        self._enter(UpdatePhase.DRAINING)
        window_start = self._monotonic()
        how = await pipeline.drain(request.drain.mode, float(request.drain.timeout_seconds))
        record.message = f"drained ({how})"
        lap("drain")

        self._enter(UpdatePhase.LOADING)
        await pipeline.mark_unaccepted(request.id)
        begin = check_session(
            await self._call_ranks(
                BEGIN, spec.model_dump_json(by_alias=True), self.config.begin_timeout, world
            ),
            request.id,
        )
        lap("begin")
        if not begin.ok:
            raise _Failed(begin.problems)
        load_call, load_arg = (
            (APPLY, "{}") if prefetch else (LOAD, source.model_dump_json(by_alias=True))
        )
        load = check_session(
            await self._call_ranks(load_call, load_arg, self.config.load_timeout, world),
            request.id,
        )
        pipeline.metrics.bytes_loaded.inc(sum(report.bytes_loaded for report in load.reports))
        lap("load")
        if not load.ok:
            raise _Failed(load.problems)

        self._enter(UpdatePhase.VERIFYING)
        self._finish_sent = True
        manifest_digest = None if manifest is None else manifest.digest
        finish = check_commit(
            await self._call_ranks(FINISH, "{}", self.config.finish_timeout, world),
            request.id,
            request.version,
            manifest_digest,
            expected_digest=None
            if manifest is None or request.mode is UpdateMode.SPARSE
            else manifest.rank_digest(),
        )
        lap("finish")
        if not finish.ok:
            raise _Failed(finish.problems)

        async def still_published() -> list[Problem]:
            return await manifest_unchanged(self.config, request, manifest_digest)

        problems = await pipeline.confirm(world, request.id, request.version, (still_published,))
        lap("verify")
        if problems:
            raise _Failed(problems)
        await pipeline.commit(request.version, request.id, request.source)
        lap("resume")
        record.timings["window"] = round(self._monotonic() - window_start, 6)
        record.message = f"committed version {request.version} on {world} rank(s); {how}"
        self._finish(UpdatePhase.COMMITTED, [])
        logger.info("Committed update %s (version %s)", record.id, request.version)

    async def _preflight(self) -> tuple[Manifest | None, str | None]:
        try:
            return await preflight(self.config, self.record.request)
        except ManifestRefused as e:
            raise _Failed(e.problems) from e

    def _hold(self) -> None:
        self.pipeline.hold(
            Problem(
                "update_incomplete",
                f"update {self.record.request.id} started and has not committed",
            )
        )
        self._held = True

    async def _prefetch(self, args: PrefetchArgs, world: int) -> None:
        """Every rank reads and verifies the checkpoint into host staging while the replica
        serves; returns once every rank reports ``ready`` (bounded by the load timeout)."""
        request = self.record.request
        self._enter(UpdatePhase.PREFETCHING)
        self._prefetch_sent = True
        started = check_session(
            await self._call_ranks(
                PREFETCH, args.model_dump_json(by_alias=True), self.config.begin_timeout, world
            ),
            request.id,
        )
        if not started.ok:
            raise _Failed(started.problems)
        deadline = self._monotonic() + self.config.load_timeout
        while True:
            round_, waiting = await self._prefetched(world)
            if not waiting:
                break
            if self._monotonic() > deadline:
                raise _Failed(
                    [
                        Problem(
                            "prefetch_timeout",
                            f"ranks still reading after {self.config.load_timeout}s: "
                            + ", ".join(waiting),
                        )
                    ]
                )
            await asyncio.sleep(PREFETCH_POLL_SECONDS)  # a poll interval, not a synchronisation
        staged = sum(report.staged_bytes for report in round_.reports)
        self.record.message = f"prefetched {staged} bytes on {world} rank(s)"
        self._enter(UpdatePhase.PREFETCHED)

    async def _prefetched(self, world: int) -> tuple[RankRound, list[str]]:
        """Ask every rank how its prefetch stands: the round, and the ranks not ``ready``."""
        round_ = check_session(
            await self._call_ranks(PREFETCHED, "{}", self.config.control_timeout, world),
            self.record.request.id,
        )
        if not round_.ok:
            raise _Failed(round_.problems)
        return round_, prefetch_waiting(round_.reports)

    async def _await_swap(self, world: int) -> None:
        """Park in ``Prefetched``, serving, until the swap; past the deadline fail before the
        hold (staging freed, nothing poisoned). The ranks are asked once more after the go: a
        rank restarted meanwhile holds no staging, and that too is found before the drain."""
        request = self.record.request
        deadline = request.prefetch.swap_deadline_seconds
        self.record.message += f"; waiting for POST /v1/updates/{request.id}/swap"
        self.pipeline.store.save()
        # Judged on the injected clock, not the event loop's: the simulation tier runs on
        # virtual time, and a deadline kept in real seconds never passed there however far its
        # clock went (nor could a schedule replay one that did).
        end = self._monotonic() + deadline
        while not self._swap.is_set():
            left = end - self._monotonic()
            if left > 0:
                await _first_of(self._swap.wait(), self._sleep(left))
                continue
            raise _Failed(
                [
                    Problem(
                        "swap_deadline",
                        f"no swap within prefetch.swapDeadlineSeconds={deadline} after "
                        "Prefetched; the staging was freed and the replica serves on",
                    )
                ]
            )
        _, waiting = await self._prefetched(world)
        if waiting:
            raise _Failed(
                [
                    Problem(
                        "prefetch_lost", "ranks no longer hold the staging: " + ", ".join(waiting)
                    )
                ]
            )
        self.record.message = f"swap requested; prefetched on {world} rank(s)"

    # -- the verdict -----------------------------------------------------------------------

    async def _close_session(self, first: Problem) -> list[Problem]:
        """Abort the ranks' session (poisoning them once anything may have been written)."""
        record = self.record
        if record.phase not in (UpdatePhase.LOADING, UpdatePhase.VERIFYING):
            return await self._free_prefetch()  # no session was opened
        try:
            results = await self.client.collective_rpc(
                ABORT, abort_args(record, first, self._finish_sent), self.config.control_timeout
            )
        except EngineError as e:
            return [Problem("abort_failed", f"weightroll_abort: {e}")]
        reports = [r for r in results if isinstance(r, dict)]
        _merge_ranks(record, collect_reports(ABORT, reports, len(reports)).reports)
        return []

    async def _fail(self, problems: list[Problem], phase: UpdatePhase) -> None:
        """Close the rank sessions, keep generation paused, record the verdict.

        A prefetched update that fails before its hold wrote nothing and paused nothing: its
        staging is freed and the replica serves on (:meth:`_fail_serving`)."""
        if not self._held:
            await self._fail_serving(problems, phase)
            return
        record = self.record
        await self.pipeline.fail(f"update {record.id}", problems, self._close_session)
        self._finish(phase, problems)
        logger.warning(
            "Update %s ended %s; generation stays paused: %s",
            record.id,
            phase.value,
            "; ".join(map(str, problems)),
        )

    async def _fail_serving(self, problems: list[Problem], phase: UpdatePhase) -> None:
        problems += await self._free_prefetch()
        for problem in problems:
            self.pipeline.metrics.verification_failures.labels(reason=problem.code).inc()
        self._finish(phase, problems)
        logger.warning(
            "Update %s ended %s before the drain; the replica serves its old weights: %s",
            self.record.id,
            phase.value,
            "; ".join(map(str, problems)),
        )

    async def _free_prefetch(self) -> list[Problem]:
        """Free the ranks' staging (an abort without poison: nothing was written)."""
        if not self._prefetch_sent:
            return []
        try:
            await self.client.collective_rpc(ABORT, "{}", self.config.control_timeout)
        except EngineError as e:
            return [Problem("abort_failed", f"weightroll_abort: {e}")]
        return []

    def _finish(self, phase: UpdatePhase, problems: Sequence[Problem]) -> None:
        pipeline = self.pipeline
        finish_record(pipeline.store, pipeline.metrics, self.record, phase, problems, self._stamp())
