"""The agent: one replica's update from drain to commit, and the fail-closed guard around it.

Update flow (one at a time, driven by ``POST /v1/updates``)::

    Pending    world size; manifest loaded and checked (pin, signature, digest, version, base)
    Draining   POST /pause?mode=wait (bounded by drain.timeoutSeconds, then mode=abort)
    Loading    weightroll_begin(spec) and weightroll_load(source) on every rank
    Verifying  weightroll_finish() on every rank → all-rank agreement (ranks.check_commit)
               → weightroll_state() confirms → POST /reset_prefix_cache
    Committed  POST /resume — the only place generation is resumed

Invariants:
    * **Accepted means held.** From the moment an update is accepted the replica holds a *hold*
      (a reason to stay paused) that only a committed update clears. Every failure, abort,
      timeout or crash therefore ends with generation paused and ``/readyz`` 503, and the verdict
      (or ``/v1/state`` message) names the cause. The hold is persisted when a state directory
      is configured, so it survives an agent restart.
    * **Ranks are counted, not trusted.** Every ``collective_rpc`` result list goes through
      ``ranks.collect_reports`` with the world size read before the update.
    * **Every call is bounded** (``AgentConfig`` timeouts); a late rank is a failed rank.
    * **The guard re-asserts the hold.** A background loop observes the ranks; if vLLM was
      restarted underneath the agent (ranks at another version, session gone, unpaused while
      held) it pauses generation again and records why.
    * After a failure the open session is aborted on every rank (``weightroll_abort``: structural
      cleanup, never a rollback; a dirty engine becomes poisoned and needs a full update).
    * **The fence holds after finish.** Once ``weightroll_finish`` was sent, any rejection (a
      rank or agreement problem, a manifest re-published mid-update, a failed cache reset, a
      timeout) aborts with ``poison: true``: ranks that committed a version the agent did not
      accept are poisoned, not left clean at it.
    * **Accepted is recorded outside the agent.** Before ``weightroll_begin`` the agent sets
      vLLM's own weight version (``/update_weight_version``) to ``weightroll-unaccepted:<id>``
      and only after every check passed to the update's version. An agent restarted without its
      state file adopts the ranks' version only when vLLM's weight version names it (or is
      vLLM's boot value ``default``: no agent ever touched this engine).
    * **Partial and sparse build only on what was accepted.** They are refused (409) unless the
      agent holds an accepted version and no hold, and their ``baseVersion`` must be it.

Time is injected (``now`` for timestamps, ``monotonic`` for durations) for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Final

from engine_agent.manifest import Manifest, ManifestError, load_manifest
from engine_agent.protocol import (
    STILL_TRUE_VIOLATED,
    AgentState,
    DrainMode,
    DrainSpec,
    EngineState,
    ExtensionRpc,
    LoadSource,
    RankReport,
    RankStatus,
    SourceSpec,
    UpdateMode,
    UpdatePhase,
    UpdateRequest,
    Verdict,
)
from engine_agent.sidecar.confinement import SourceRefused, confine
from engine_agent.sidecar.engine import EngineError, EngineTimeout, VllmClient
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.ranks import (
    Problem,
    RankRound,
    StateRound,
    check_commit,
    check_session,
    collect_reports,
    collect_states,
    committed_problems,
)
from engine_agent.sidecar.signing import (
    ManifestSignatureInvalid,
    ManifestVerifier,
    signature_source,
    unsigned_update,
)
from engine_agent.sidecar.state import AgentMemory, Store, UpdateRecord

__all__ = ["Agent", "AgentConfig", "Readiness", "SourceRefused", "UpdateConflict", "UpdateNotFound"]

logger = logging.getLogger(__name__)

BEGIN: Final = ExtensionRpc.BEGIN
LOAD: Final = ExtensionRpc.LOAD
FINISH: Final = ExtensionRpc.FINISH
ABORT: Final = ExtensionRpc.ABORT
STATE: Final = ExtensionRpc.STATE
#: vLLM's weight version while an update has not been accepted (``/update_weight_version``).
UNACCEPTED_PREFIX: Final = "weightroll-unaccepted:"
#: vLLM's weight version before anything set it.
VLLM_DEFAULT_VERSION: Final = "default"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Tunables of the agent; every field has an env var and a flag (see ``main.py``)."""

    #: Loopback URL of the local vLLM OpenAI server.
    vllm_url: str = "http://127.0.0.1:8000"
    #: Bound of ``weightroll_begin`` (snapshots identity on every rank).
    begin_timeout: float = 120.0
    #: Bound of ``weightroll_load`` (reads the whole checkpoint on every rank).
    load_timeout: float = 1800.0
    #: Bound of ``weightroll_finish`` (coverage, identity, digest).
    finish_timeout: float = 300.0
    #: Bound of ``weightroll_state`` and ``weightroll_abort``.
    control_timeout: float = 30.0
    #: Bound of ``/pause?mode=abort``.
    abort_pause_timeout: float = 60.0
    #: Seconds ``POST /v1/updates/{id}/abort`` waits for the update to wind down.
    abort_wait: float = 1.0
    #: Seconds between two observations by the guard.
    watch_interval: float = 5.0
    #: Seconds a trainer push may stay open without a trainer call before the agent ends it
    #: (fenced, failed as ``push_abandoned``): a trainer that died between steps never calls
    #: finish, and the replica must not stay held by it for ever.
    push_idle_timeout: float = 900.0
    #: Networks a trainer's rendezvous address (``init_info.master_address``) may lie in
    #: (``engine_agent.transfer.rendezvous``); empty refuses every trainer push.
    trainer_networks: tuple[IPv4Network | IPv6Network, ...] = ()
    #: The trainers' bearer tokens (one per line), for the native weight-transfer routes only;
    #: ``None`` closes those routes. The ``--token-file`` tokens never open them.
    trainer_token_file: Path | None = None
    #: Seconds an observation is reused by ``/readyz`` and ``/v1/state``.
    observe_ttl: float = 1.0
    #: Directory for the persisted store (an ``emptyDir``); ``None`` keeps memory only.
    state_dir: Path | None = None
    #: Source of the weights vLLM starts with (reported by ``/v1/state`` until an update).
    initial_source: SourceSpec | None = None
    #: Version vLLM starts with; ``None`` adopts what the ranks report at start-up.
    initial_version: str | None = None
    #: Directory under which weight sources and manifests are resolved (``/models/v2`` is read
    #: at ``<source_root>/models/v2``); ``None`` reads them as given. Sources keep their
    #: pod-view URIs everywhere else (records, ``/v1/state``). For pod simulators without mount
    #: namespaces (``weightroll_dev.devcluster``), where each pod has its own volume root.
    source_root: Path | None = None
    #: Directory, as the pods see it (the model volume's mount path, e.g. ``/models``), inside
    #: which every update's ``source.uri`` and ``source.manifest`` must resolve, symlinks and
    #: ``..`` followed; ``None``: inside ``source_root`` when that is set, else anywhere.
    model_dir: str | None = None
    #: PEM public key (EC) every update's manifest must be signed with (``<manifest>.sig``, an
    #: OpenSSF model-signing bundle; :mod:`engine_agent.sidecar.signing`); ``None``: unsigned.
    manifest_public_key: Path | None = None

    def local_path(self, path: str) -> str:
        """Where this process reads a source path (``path`` itself without ``source_root``)."""
        if self.source_root is None:
            return path
        return str(self.source_root / path.lstrip("/"))

    def check_source(self, source: SourceSpec) -> None:
        """Refuse a source outside :attr:`model_dir` (or :attr:`source_root`); see
        :func:`~engine_agent.sidecar.confinement.confine`.

        Raises:
            SourceRefused: naming ``source.uri`` or ``source.manifest``.
        """
        if self.model_dir is not None:
            jail, where = self.local_path(self.model_dir), f"the model directory {self.model_dir}"
        elif self.source_root is not None:
            jail, where = str(self.source_root), "the source root"
        else:
            return
        confine(source, jail=jail, where=where, local_path=self.local_path)


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


@dataclass(slots=True)
class _Observation:
    at: float
    reachable: bool
    paused: bool | None = None
    world_size: int | None = None
    states: StateRound | None = None
    problems: list[Problem] = field(default_factory=list)


def _abort_args(record: UpdateRecord, cause: Problem, finish_sent: bool = False) -> str:
    """``weightroll_abort`` argument: fence every rank when any rank may have written.

    A rank whose own call failed before writing returns to clean, but the replica is mixed if
    another rank wrote (or its state is unknown): then every rank must be poisoned, or a later
    partial update would be accepted by the "clean" ranks (docs/contracts.md, replica fence).
    Once ``finish`` was sent, ranks may have committed a version the agent now rejects: always
    poison then.
    """
    written = (
        finish_sent
        or not record.ranks
        or any(report.state in (EngineState.DIRTY, EngineState.POISONED) for report in record.ranks)
    )
    if not written:
        return "{}"
    reason = f"update {record.id} did not commit on every rank: {cause.message}"
    return json.dumps({"poison": True, "reason": reason[:500]})


def _commit_on_ranks(memory: AgentMemory, ranks: Sequence[RankStatus]) -> bool:
    """Every rank still serves what the agent's last commit produced (``None`` on both sides:
    the boot weights). A rank naming another commit than the agent's, or none, is not."""
    committed = memory.committed_update_id
    return all(r.committed_update_id == committed for r in ranks)


def _committed_by(ranks: Sequence[RankStatus]) -> str:
    ids = sorted({r.committed_update_id or "none (boot weights)" for r in ranks})
    return ", ".join(ids)


class _Failed(Exception):
    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.problems = list(problems)


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
    ) -> None:
        self.config = config
        self.client = client or VllmClient(config.vllm_url)
        self.metrics = metrics or AgentMetrics()
        self.store = Store(config.state_dir)
        self._now = now
        self._monotonic = monotonic
        self._task: asyncio.Task[None] | None = None
        self._guard: asyncio.Task[None] | None = None
        self._recovered = asyncio.Event()
        self._observation: _Observation | None = None
        self._observe_lock = asyncio.Lock()
        self._last_ranks: list[RankStatus] = []
        self._last_state: EngineState | None = None
        self._message = ""
        self._stopping = False
        #: Set while another path owns the replica (a trainer push through the native routes,
        #: engine_agent/sidecar/transfer_routes.py): file updates are refused meanwhile.
        self.busy: str | None = None
        #: Called by the guard while :attr:`busy` is set: the push owner checks that its push is
        #: still alive (the ranks hold its session, the trainer still calls) and ends it if not.
        self.busy_watchdog: Callable[[], Awaitable[None]] | None = None

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
            problem = Problem(
                "agent_restarted",
                f"the agent restarted during phase {interrupted.phase.value}; the session was "
                "aborted on every rank and generation stays paused",
            )
            self._finish_record(interrupted, UpdatePhase.FAILED, [problem])
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
        self._observation = None

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
        active = self.store.active
        if active is not None and not active.phase.terminal:
            raise UpdateConflict(
                f"update {active.id!r} is in progress (phase {active.phase.value})", active.id
            )
        if self.busy is not None:
            raise UpdateConflict(self.busy)
        if not self.recovered:
            raise UpdateConflict("the agent has not yet recovered the engine state; retry")
        refusal = self._base_refusal(request)
        if refusal is not None:
            raise UpdateConflict(refusal)
        record = UpdateRecord(request=request, started_at=self._stamp())
        self.store.add(record)
        self.store.active_id = record.id
        self.store.save()
        logger.info("Accepted update %s to version %s", record.id, request.version)
        self._task = asyncio.create_task(self._run(record), name=f"weightroll-update-{record.id}")
        return True, record

    def _base_refusal(self, request: UpdateRequest) -> str | None:
        """Why a partial or sparse ``request`` may not build on this replica (None: it may)."""
        if request.mode is UpdateMode.FULL:
            return None
        memory = self.store.memory
        what = f"a {request.mode.value} update builds on the version this agent accepted"
        if memory.hold is not None:
            return f"{what}, but the replica is held ({memory.hold}); send a full update"
        if memory.expected_version is None:
            return f"{what}, and it has accepted none; send a full update"
        if memory.source is None:
            # A trainer push (or a commit adopted after a restart without state) may carry any
            # label: a delta computed against the checkpoint of that label would be applied to
            # other bytes.
            return (
                f"{what} ({memory.expected_version}), but the files it serves are unknown "
                "(pushed by a trainer, or adopted after an agent restart); send a full update"
            )
        if request.base_version != memory.expected_version:
            return (
                f"{what} ({memory.expected_version}), but its baseVersion is {request.base_version}"
            )
        return None

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

    async def readiness(self) -> Readiness:
        """Fail-closed readiness: every rank committed at the expected version, not paused."""
        ready, reasons = await self._readiness()
        self.metrics.ready.set(1 if ready else 0)
        return Readiness(ready, tuple(reasons))

    async def state(self) -> AgentState:
        """Render ``GET /v1/state`` (observes the ranks unless an update runs)."""
        ready, reasons = await self._readiness()
        observation = self._observation
        memory = self.store.memory
        paused = bool(observation and observation.paused)
        if self.store.active is not None:
            paused = self.store.active.phase is not UpdatePhase.PENDING
        # What the ranks serve now (one version on every rank), never the agent's record alone:
        # a vLLM restarted under a committed agent serves its boot weights again.
        live = {r.version for r in self._last_ranks}
        reachable = observation is None or observation.reachable or self._updating()
        version = next(iter(live)) if len(live) == 1 and reachable else ""
        # The label alone is not the commit: a vLLM restarted onto boot weights labelled like
        # the last commit reports that label too, but no longer the commit's id on its ranks.
        at_commit = (
            version != ""
            and version == memory.expected_version
            and _commit_on_ranks(memory, self._last_ranks)
        )
        serves_commit = not self._updating() and at_commit and self._last_state is EngineState.CLEAN
        message = "; ".join(reasons) if not ready else self._message
        return AgentState(
            version=version,
            # Unknown (vLLM never reached) is reported as poisoned: not safe to serve.
            engine_state=self._last_state or EngineState.POISONED,
            ready=ready,
            paused=paused,
            active_update_id=self.store.active_id,
            # none when vLLM cannot be asked (booting, down): the last ones would be stale,
            # and an empty list is how a caller tells a booting engine from disagreeing ranks
            ranks=list(self._last_ranks) if reachable else [],
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

    async def _observe(self, *, fresh: bool = False) -> _Observation:
        async with self._observe_lock:
            last = self._observation
            if (
                not fresh
                and last is not None
                and self._monotonic() - last.at < self.config.observe_ttl
            ):
                return last
            observation = await self._observe_now()
            self._observation = observation
            return observation

    async def _observe_now(self) -> _Observation:
        at = self._monotonic()
        try:
            # Concurrently: under load vLLM's API server answers each call slowly.
            paused, world, results = await asyncio.gather(
                self.client.is_paused(),
                self.client.world_size(),
                self.client.collective_rpc(STATE, "{}", self.config.control_timeout),
            )
        except EngineError as e:
            self._last_state = None
            self.metrics.set_engine_state(None)
            return _Observation(at, False, problems=[Problem(e.code, str(e))])
        states = collect_states(results, world)
        self._last_ranks = list(states.statuses)
        self._last_state = states.state
        self.metrics.set_engine_state(states.state)
        self.metrics.still_true_violated.set(
            any((r.poison_reason or "").startswith(STILL_TRUE_VIOLATED) for r in states.statuses)
        )
        return _Observation(at, True, paused, world, states, list(states.problems))

    def _faults(self, observation: _Observation) -> list[Problem]:
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
            # The rank's guard found its live weights changed after its commit (issue 26 E).
            changed = any(
                (s.poison_reason or "").startswith(STILL_TRUE_VIOLATED) for s in states.statuses
            )
            code = STILL_TRUE_VIOLATED if changed else "engine_not_clean"
            problems.append(Problem(code, f"ranks report {state.value}{detail}"))
        expected = self.store.memory.expected_version
        if expected is not None and states.versions and states.versions != {expected}:
            problems.append(
                Problem(
                    "engine_restarted",
                    f"ranks serve version {', '.join(sorted(states.versions))} but the agent "
                    f"committed {expected}; vLLM was restarted or changed underneath the agent",
                )
            )
        elif states.statuses and not _commit_on_ranks(self.store.memory, states.statuses):
            problems.append(
                Problem(
                    "engine_restarted",
                    f"ranks serve version {expected} but not what the agent's last commit "
                    f"{self.store.memory.committed_update_id} loaded (theirs: "
                    f"{_committed_by(states.statuses)}); vLLM was restarted onto boot weights "
                    "with the same label, or changed by a commit the agent did not record",
                )
            )
        return problems

    async def _readiness(self) -> tuple[bool, list[str]]:
        if self._updating():
            return False, [self._in_progress()]
        held = [] if self.store.memory.hold is None else [f"held: {self.store.memory.hold}"]
        if not self.recovered:
            return False, [*held, "the agent has not yet recovered the engine state"]
        observation = await self._observe()
        if self._updating():  # an update started while we observed
            return False, [self._in_progress()]
        if not observation.reachable:
            return False, [*held, *(str(problem) for problem in observation.problems)]
        faults = self._faults(observation)
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
        if self.busy is not None:
            return self.busy
        active = self.store.active
        assert active is not None
        return f"update {active.id} in progress (phase {active.phase.value})"

    async def _guard_loop(self) -> None:
        await self._recover()
        while True:
            try:
                await self._guard_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the guard must never die
                logger.exception("Guard pass failed")
            await asyncio.sleep(self.config.watch_interval)

    def _updating(self) -> bool:
        if self.busy is not None:
            return True
        active = self.store.active
        return active is not None and not active.phase.terminal

    async def _guard_once(self) -> None:
        if self.busy is not None and self.busy_watchdog is not None:
            await self.busy_watchdog()
        if self._updating():
            return
        ready, _ = await self._readiness()
        self.metrics.ready.set(1 if ready else 0)
        observation = self._observation
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
                self._observation = None

    async def _recover(self) -> None:
        """Re-derive the engine state from the ranks once vLLM answers (runs at start-up)."""
        while True:
            observation = await self._observe(fresh=True)
            if observation.reachable:
                break
            self._message = f"waiting for vLLM at {self.client.base_url}"
            await asyncio.sleep(min(1.0, self.config.watch_interval))
        states = observation.states
        assert states is not None
        open_ids = sorted(
            {
                s.update_id or "?"
                for s in states.statuses
                if s.state in (EngineState.OPEN, EngineState.DIRTY)
            }
        )
        if open_ids:
            logger.warning("Aborting session(s) %s left open on the ranks", ", ".join(open_ids))
            with contextlib.suppress(EngineError):
                await self.client.collective_rpc(ABORT, "{}", self.config.control_timeout)
            self._message = f"aborted session(s) {', '.join(open_ids)} found open at start-up"
            if self.store.memory.hold is None:
                self._set_hold(
                    Problem(
                        "agent_restarted",
                        f"found session(s) {', '.join(open_ids)} open at start-up (agent "
                        "restarted mid-update); aborted them",
                    )
                )
            observation = await self._observe(fresh=True)
            states = observation.states or states
        memory = self.store.memory
        if (
            memory.expected_version is None
            and states.ok
            and states.state is EngineState.CLEAN
            and len(states.versions) == 1
        ):
            await self._adopt(next(iter(states.versions)))
        self._adopt_commit(states)
        faults = self._faults(observation)
        if faults and memory.hold is None:
            self._set_hold(faults[0])
        self.store.save()
        self._recovered.set()
        logger.info("Recovered engine state: %s", self._last_state or "unknown")

    async def _adopt(self, version: str) -> None:
        """Adopt the ranks' ``version`` only if an agent accepted it (restart without state)."""
        try:
            marker = await self.client.weight_version()
        except EngineError as e:
            self._set_hold(Problem("version_not_accepted", f"cannot read vLLM's version: {e}"))
            return
        if marker in (version, VLLM_DEFAULT_VERSION):
            self.store.memory.expected_version = version
            logger.info("Adopted version %s reported by every rank", version)
            return
        self._set_hold(
            Problem(
                "version_not_accepted",
                f"the ranks serve {version}, which no agent accepted (vLLM's weight version is "
                f"{marker!r}); a full update is required",
            )
        )

    def _adopt_commit(self, states: StateRound) -> None:
        """Restarted without its state, the agent learns from the ranks which commit they
        serve (they keep it in-process), so a later restart of vLLM onto boot weights with the
        same label is still told apart. Where that commit's files came from is lost with the
        state: the source becomes unknown, and a WeightUpdate reloads such a pod."""
        memory = self.store.memory
        ids = {status.committed_update_id for status in states.statuses}
        if (
            memory.committed_update_id is not None
            or memory.hold is not None
            or not states.ok
            or states.state is not EngineState.CLEAN
            or states.versions != {memory.expected_version}
            or len(ids) != 1
            or None in ids
        ):
            return  # nothing to learn; disagreeing ranks are held by _faults
        memory.committed_update_id = ids.pop()
        memory.source = None
        logger.info(
            "Adopted commit %s (version %s) reported by every rank; its source is unknown",
            memory.committed_update_id,
            memory.expected_version,
        )

    # ------------------------------------------------------------------ the update

    def _stamp(self) -> str:
        return self._now().isoformat().replace("+00:00", "Z")

    def _set_hold(self, problem: Problem) -> None:
        self.store.memory.hold = str(problem)
        self.store.memory.hold_code = problem.code

    def _merge_ranks(self, record: UpdateRecord, reports: Sequence[RankReport]) -> None:
        by_key = {report.rank.key: report for report in record.ranks}
        for report in reports:
            by_key[report.rank.key] = report
        record.ranks = [by_key[key] for key in sorted(by_key)]

    def _enter(self, record: UpdateRecord, phase: UpdatePhase) -> None:
        record.phase = phase
        self.store.save()
        logger.info("Update %s entered phase %s", record.id, phase.value)

    async def _call_ranks(
        self, record: UpdateRecord, method: ExtensionRpc, arg: str, timeout: float, world: int
    ) -> RankRound:
        results = await self.client.collective_rpc(method, arg, timeout)
        round_ = collect_reports(method, results, world)
        self._merge_ranks(record, round_.reports)
        return round_

    async def _drain(self, spec: DrainSpec) -> str:
        if spec.mode is DrainMode.WAIT and spec.timeout_seconds > 0:
            try:
                await self.client.pause(DrainMode.WAIT, float(spec.timeout_seconds))
                return "wait"
            except EngineTimeout:
                logger.warning(
                    "Drain did not finish in %ss; aborting the requests left",
                    spec.timeout_seconds,
                )
                await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
                return "abort after timeout"
        await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
        return "abort"

    def _check_manifest(self, request: UpdateRequest, manifest: Manifest) -> list[Problem]:
        problems: list[Problem] = []
        if manifest.version is not None and manifest.version != request.version:
            problems.append(
                Problem(
                    "manifest_version_mismatch",
                    f"manifest is for version {manifest.version} but the update is to "
                    f"{request.version}",
                )
            )
        if request.mode is UpdateMode.SPARSE and manifest.base_version != request.base_version:
            problems.append(
                Problem(
                    "manifest_base_mismatch",
                    f"manifest applies to base version {manifest.base_version} but the update "
                    f"says {request.base_version}",
                )
            )
        return problems

    async def _load_manifest(
        self, request: UpdateRequest, manifest_path: str
    ) -> tuple[Manifest, str | None]:
        """Load the update's manifest (and, with a public key, verify its signature).

        Returns:
            The manifest and the pin the ranks check their own read against.
        """
        local, pin = self.config.local_path(manifest_path), request.source.manifest_digest
        key = self.config.manifest_public_key
        if key is None:
            return await asyncio.to_thread(load_manifest, local, pinned=pin), pin
        try:  # the .sig must stay in the model directory too
            self.config.check_source(signature_source(request.source))
        except SourceRefused as e:
            raise ManifestSignatureInvalid(str(e)) from e
        verifier = ManifestVerifier(key)
        return await asyncio.to_thread(
            verifier.load_manifest, local, version=request.version, pinned=pin
        )

    async def _run(self, record: UpdateRecord) -> None:
        request = record.request
        started = self._monotonic()
        step_start = started
        drained = False
        finish_sent = False

        def lap(name: str) -> None:
            nonlocal step_start
            now = self._monotonic()
            record.timings[name] = round(record.timings.get(name, 0.0) + now - step_start, 6)
            if name in ("drain", "begin", "load", "finish", "verify", "resume"):
                self.metrics.phase_duration.labels(phase=name).observe(now - step_start)
            step_start = now

        # Accepted means held: from here only a commit clears the hold.
        self._set_hold(
            Problem("update_incomplete", f"update {request.id} started and has not committed")
        )
        self.store.save()
        try:
            world = await self.client.world_size()
            manifest_digest: str | None = None
            manifest: Manifest | None = None
            manifest_path = request.source.manifest_path
            # The pin the ranks check the manifest they read against: the update's, or (signed)
            # that of the bytes whose signature verified.
            rank_pin = request.source.manifest_digest
            try:
                # With source.manifestDigest the bytes parsed are the bytes hashed against the
                # pin (and whose signature is checked), all before the drain: a swapped manifest
                # writes nothing.
                if manifest_path is not None:
                    manifest, rank_pin = await self._load_manifest(request, manifest_path)
                elif self.config.manifest_public_key is not None:
                    raise unsigned_update(self.config.manifest_public_key)
            except ManifestError as e:
                raise _Failed([Problem(e.code, str(e))]) from e
            if manifest is not None:
                problems = self._check_manifest(request, manifest)
                if problems:
                    raise _Failed(problems)
                manifest_digest = manifest.digest
            lap("preflight")

            self._enter(record, UpdatePhase.DRAINING)
            how = await self._drain(request.drain)
            drained = True
            record.message = f"drained ({how})"
            lap("drain")

            self._enter(record, UpdatePhase.LOADING)
            # Not accepted until every check passed: a restarted agent must not adopt it.
            await self.client.set_weight_version(UNACCEPTED_PREFIX + request.id)
            # A delta names the commit it builds on; each rank refuses it unless it serves
            # exactly that one (a restart since the agent last looked is caught there).
            base = self.store.memory.committed_update_id
            spec = request.engine_spec(base).model_dump_json(by_alias=True)
            begin = check_session(
                await self._call_ranks(record, BEGIN, spec, self.config.begin_timeout, world),
                request.id,
            )
            lap("begin")
            if not begin.ok:
                raise _Failed(begin.problems)
            source = LoadSource(
                path=self.config.local_path(request.source.path),
                manifest=None if manifest_path is None else self.config.local_path(manifest_path),
                manifest_digest=rank_pin,
            )
            arg = source.model_dump_json(by_alias=True)
            load = check_session(
                await self._call_ranks(record, LOAD, arg, self.config.load_timeout, world),
                request.id,
            )
            loaded = sum(report.bytes_loaded for report in load.reports)
            self.metrics.bytes_loaded.inc(loaded)
            lap("load")
            if not load.ok:
                raise _Failed(load.problems)

            self._enter(record, UpdatePhase.VERIFYING)
            finish_sent = True
            finish = check_commit(
                await self._call_ranks(record, FINISH, "{}", self.config.finish_timeout, world),
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
            after = collect_states(
                await self.client.collective_rpc(STATE, "{}", self.config.control_timeout), world
            )
            problems = committed_problems(after, request.id, request.version)
            if not problems and not await self._reset_prefix_cache():
                problems.append(
                    Problem("cache_reset_failed", "vLLM refused to reset the prefix cache")
                )
            if not problems and manifest_path is not None:
                problems += await self._manifest_unchanged(request, manifest_path, manifest_digest)
            lap("verify")
            if problems:
                raise _Failed(problems)
            await self.client.set_weight_version(request.version)

            # Committed on every rank: adopt the version, clear the hold, then resume.
            self.store.memory.commit(request.version, request.id, request.source)
            self.store.save()
            await self.client.resume()
            lap("resume")
            record.timings["total"] = round(self._monotonic() - started, 6)
            record.message = f"committed version {request.version} on {world} rank(s); {how}"
            self._finish_record(record, UpdatePhase.COMMITTED, [])
            logger.info("Committed update %s (version %s)", record.id, request.version)
        except asyncio.CancelledError:
            during = record.phase.value
            problem = (
                Problem("agent_stopped", f"the agent stopped during {during}")
                if self._stopping
                else Problem("aborted", f"update aborted by request during {during}")
            )
            await asyncio.shield(
                self._cleanup(record, [problem], UpdatePhase.ABORTED, drained, finish_sent)
            )
            record.timings["total"] = round(self._monotonic() - started, 6)
        except _Failed as e:
            await asyncio.shield(
                self._cleanup(record, e.problems, UpdatePhase.FAILED, drained, finish_sent)
            )
            record.timings["total"] = round(self._monotonic() - started, 6)
        except EngineError as e:
            problem = Problem(e.code, f"{record.phase.value}: {e}")
            await asyncio.shield(
                self._cleanup(record, [problem], UpdatePhase.FAILED, drained, finish_sent)
            )
            record.timings["total"] = round(self._monotonic() - started, 6)
        except Exception as e:  # a bug must still fail closed
            logger.exception("Update %s crashed", record.id)
            problem = Problem("agent_error", f"{record.phase.value}: {type(e).__name__}: {e}")
            await asyncio.shield(
                self._cleanup(record, [problem], UpdatePhase.FAILED, drained, finish_sent)
            )
        finally:
            self._observation = None
            self.store.save()

    async def _reset_prefix_cache(self) -> bool:
        for attempt in range(3):
            if await self.client.reset_prefix_cache():
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        return False

    async def _manifest_unchanged(
        self, request: UpdateRequest, manifest_path: str, digest: str | None
    ) -> list[Problem]:
        """The manifest the ranks verified against is still the one published (not re-published
        while the update ran); otherwise the replica holds bytes of a superseded checkpoint."""
        try:
            now = await asyncio.to_thread(load_manifest, self.config.local_path(manifest_path))
        except ManifestError as e:
            return [Problem("manifest_changed", f"the manifest cannot be read any more: {e}")]
        if now.digest != digest:
            return [
                Problem(
                    "manifest_changed",
                    f"the manifest of {request.source.uri} was re-published during the update "
                    f"(digest {str(digest)[:12]} -> {now.digest[:12]})",
                )
            ]
        return []

    async def _cleanup(
        self,
        record: UpdateRecord,
        problems: list[Problem],
        phase: UpdatePhase,
        drained: bool,
        finish_sent: bool = False,
    ) -> None:
        """Close the rank sessions, keep generation paused, record the verdict."""
        first = problems[0] if problems else Problem("failed", "update failed")
        self._set_hold(Problem(first.code, f"update {record.id} did not commit: {first.message}"))
        if record.phase in (UpdatePhase.LOADING, UpdatePhase.VERIFYING):
            try:
                results = await self.client.collective_rpc(
                    ABORT, _abort_args(record, first, finish_sent), self.config.control_timeout
                )
                reports = [r for r in results if isinstance(r, dict)]
                self._merge_ranks(record, collect_reports(ABORT, reports, len(reports)).reports)
            except EngineError as e:
                problems.append(Problem("abort_failed", f"weightroll_abort: {e}"))
        if not drained:
            with contextlib.suppress(EngineError):
                await self.client.pause(DrainMode.ABORT, self.config.abort_pause_timeout)
        for problem in problems:
            self.metrics.verification_failures.labels(reason=problem.code).inc()
        self._finish_record(record, phase, problems)
        logger.warning(
            "Update %s ended %s; generation stays paused: %s",
            record.id,
            phase.value,
            "; ".join(map(str, problems)),
        )

    def _finish_record(
        self, record: UpdateRecord, phase: UpdatePhase, problems: Sequence[Problem]
    ) -> None:
        record.phase = phase
        record.verdict = Verdict(
            committed=phase is UpdatePhase.COMMITTED, reasons=[str(p) for p in problems]
        )
        record.finished_at = self._stamp()
        if problems:
            record.message = str(problems[0])
        outcome = {
            UpdatePhase.COMMITTED: "committed",
            UpdatePhase.ABORTED: "aborted",
        }.get(phase, "failed")
        self.metrics.updates.labels(outcome=outcome).inc()
        if self.store.active_id == record.id:
            self.store.active_id = None
        self.store.save()
