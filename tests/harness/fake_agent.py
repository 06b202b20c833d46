"""Test double of the pod agent's HTTP API: a real aiohttp server speaking the protocol.

``FakeAgent`` serves ``/healthz``, ``/readyz``, ``/v1/state``, ``POST /v1/updates``,
``GET /v1/updates/{id}`` and ``POST /v1/updates/{id}/abort`` with bearer-token checks, like the
real sidecar, but "loads" weights by sleeping. Each instance binds its own loopback address
(``127.0.0.N``, all routed to lo on Linux) on a shared port, so a fleet of fake pods can use the
pod IP + one agent port exactly like a real cluster.

Scripts per version decide what an update does: ``succeed`` (Draining -> Loading -> Verifying ->
Committed), ``fail`` (-> Failed with a reason, stays paused), ``hang`` (stays Loading until
aborted), ``reject`` (the POST gets a 422 naming ``source.uri``), ``race`` (hangs like
``hang``, but the commit wins the race with the operator's abort: the abort commits the update
first, then answers 409 like an abort of a committed update). :meth:`FakeAgent.disappear`
stops the server (connection refused) and :meth:`FakeAgent.appear` brings it back with the same
state.

Every update execution is recorded in ``executions`` so a test can assert that no version was
loaded twice.

What it reports follows the real agent (``engine_agent/sidecar/agent.py``), which the contract
tests in ``tests/contract/agent`` and the real-vLLM tests in ``tests/server`` pin down:

* ``/v1/state`` ``version`` is what the ranks serve *now*; ``committedVersion`` and
  ``committedUpdateId`` are the last commit, the id only while the ranks still serve it;
* an accepted update holds the replica (not ready) until a commit clears the hold; a failed or
  aborted one keeps it held (poisoned once it wrote);
* :meth:`FakeAgent.restart_engine` is vLLM restarted under the agent: the ranks serve the boot
  weights again, clean, and the agent holds the replica (``engine_restarted``, paused, not
  ready) until a full update commits — unless nothing was committed since boot, when the
  restarted ranks serve exactly what the agent expects (no hold, as the real agent);
* :meth:`FakeAgent.booting` is a pod whose vLLM has not come up: the version is unknown
  (``""``), the engine reported poisoned, and ``POST /v1/updates`` answers 409;
* aborting a committed update answers 409 (``roll back instead``), an unknown id 404; an id
  already used for another request answers 409, the same request again 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from engine_agent.protocol import (
    AgentState,
    EngineState,
    ErrorBody,
    RankId,
    RankStatus,
    SourceSpec,
    UpdatePhase,
    UpdateRequest,
    UpdateStatus,
    Verdict,
)
from tests.harness.ports import free_port

__all__ = ["FakeAgent", "FakeFleetAgents", "Script", "free_port"]

Script = Literal["succeed", "fail", "hang", "reject", "race"]


_ATTEMPT = re.compile(r"-[0-9a-f]{8}(?=-g\d+-a\d+)|-g\d+(?=-a\d+)")


def _wall_clock() -> datetime:
    return datetime.now(UTC)


def _stamp(clock: Callable[[], datetime] = _wall_clock) -> str:
    return clock().isoformat().replace("+00:00", "Z")


@dataclass
class FakeAgent:
    """One simulated agent (one pod)."""

    pod: str
    host: str
    port: int
    token: str | None = None
    version: str = "v1"
    source: str = "/weights/v1"
    #: The manifest of ``source`` (the real agent reports the whole source it committed).
    manifest: str | None = None
    #: Seconds each of the three update phases takes.
    step: float = 0.02
    scripts: dict[str, Script] = field(default_factory=dict)
    #: The agent's record of its last commit (``None``: boot weights, ``version``).
    committed_version: str | None = None
    committed_id: str | None = None
    #: vLLM restarted since that commit: the ranks serve boot weights, which report no
    #: commit id even when their label is the committed one (as the real ranks do).
    commit_gone: bool = False
    #: Why the replica is held (not ready, paused); only a committed update clears it.
    hold: str | None = None
    #: vLLM has not come up yet: nothing is known about the ranks.
    starting: bool = False
    boot_version: str | None = None
    boot_source: str | None = None
    #: The agent's clock (its records' timestamps). A test that moves the operator's clock
    #: moves this one too, as a clock step moves every NTP-synced machine of a cluster.
    clock: Callable[[], datetime] = _wall_clock
    #: Update ids in the order they were executed (a repeated POST of a known id is not one).
    executions: list[str] = field(default_factory=list)
    updates: dict[str, UpdateStatus] = field(default_factory=dict)
    requests: dict[str, UpdateRequest] = field(default_factory=dict)
    active: str | None = None
    paused: bool = False
    engine: EngineState = EngineState.CLEAN
    #: When set, every ``/v1`` request is appended here as ``METHOD PATH`` (one line each), so a
    #: test in another process can tell whether the operator called this agent at all.
    request_log: Path | None = None
    _runner: web.AppRunner | None = None
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __post_init__(self) -> None:
        self.boot_version = self.boot_version or self.version
        self.boot_source = self.boot_source or self.source
        if self.committed_version is None:
            self.committed_version = self.version

    @property
    def ready(self) -> bool:
        return (
            not self.starting
            and self.engine is EngineState.CLEAN
            and not self.paused
            and self.active is None
            and self.hold is None
        )

    def restart_engine(self) -> None:
        """vLLM restarted under the agent: boot weights again; the agent's guard holds it."""
        self.version, self.source = str(self.boot_version), str(self.boot_source)
        self.manifest = None
        self.engine = EngineState.CLEAN
        self.commit_gone = self.committed_id is not None
        if self.committed_id is None and self.version == self.committed_version:
            # nothing committed since boot: no new hold; the guard re-pauses an older one
            self.paused = self.hold is not None
            return
        self.hold = (
            f"engine_restarted: ranks serve version {self.version} but the agent committed "
            f"{self.committed_version}; vLLM was restarted or changed underneath the agent"
            if self.version != self.committed_version
            else f"engine_restarted: ranks serve version {self.version} but not what the "
            f"agent's last commit {self.committed_id} loaded; vLLM was restarted onto boot "
            "weights with the same label"
        )
        self.paused = True

    def booting(self) -> None:
        """vLLM is not up yet (a joining pod): version unknown, updates refused with 409."""
        self.starting = True

    def booted(self) -> None:
        self.starting = False

    async def appear(self) -> None:
        app = web.Application(middlewares=[self._record])
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/v1/state", self._state),
                web.post("/v1/updates", self._start),
                web.get("/v1/updates/{id}", self._get),
                web.post("/v1/updates/{id}/abort", self._abort),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()

    async def disappear(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.disappear()

    # ---- HTTP ----------------------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.request_log is not None and request.path.startswith("/v1"):
            with self.request_log.open("a") as log:
                log.write(f"{request.method} {request.path}\n")
        response: web.StreamResponse = await handler(request)
        return response

    def _authorized(self, request: web.Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    @staticmethod
    def _error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
        body = ErrorBody(code=code, message=message, field=field).to_wire()
        return web.json_response(body, status=status)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def _state(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "unauthorized", "missing or wrong bearer token")
        if self.starting:
            state = AgentState(
                version="",
                engine_state=EngineState.POISONED,
                ready=False,
                paused=False,
                message="waiting for vLLM",
                committed_version=self.committed_version,
            )
            return web.json_response(state.to_wire())
        serves_commit = (
            self.active is None
            and self.version == self.committed_version
            and self.engine is EngineState.CLEAN
            and not self.commit_gone
        )
        source = self.source if self.engine is EngineState.CLEAN else None
        rank = RankStatus(
            rank=RankId(dp=0, pp=0, tp=0),
            state=self.engine,
            version=self.version,
            serving_safe=self.engine is EngineState.CLEAN,
            committed_update_id=None if self.commit_gone else self.committed_id,
        )
        state = AgentState(
            version=self.version,
            engine_state=self.engine,
            ready=self.ready,
            paused=self.paused,
            active_update_id=self.active,
            ranks=[rank],  # vLLM answers (while booting: none, as from the real agent)
            source=None if source is None else SourceSpec(uri=source, manifest=self.manifest),
            message=f"held: {self.hold}" if self.hold else "",
            committed_version=self.committed_version,
            committed_update_id=self.committed_id if serves_commit else None,
        )
        return web.json_response(state.to_wire())

    async def _start(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "unauthorized", "missing or wrong bearer token")
        try:
            req = UpdateRequest.model_validate(await request.json())
        except ValueError as e:
            return self._error(422, "invalid", str(e))
        if req.id in self.updates:
            if self.requests.get(req.id) != req:  # the real agent: one id, one request
                return self._error(409, "conflict", f"update id {req.id!r} was already used")
            return web.json_response(self.updates[req.id].to_wire(), status=200)
        if self.scripts.get(req.version) == "reject":
            return self._error(422, "invalid", "source.uri: no such directory", "source.uri")
        if self.active is not None:
            return self._error(409, "conflict", f"update {self.active} is active")
        if self.starting:
            return self._error(409, "conflict", "the agent has not yet recovered the engine state")
        self.active = req.id
        self.paused = True
        self.hold = f"update_incomplete: update {req.id} started and has not committed"
        self.executions.append(req.id)
        self.requests[req.id] = req
        self.updates[req.id] = UpdateStatus(
            id=req.id,
            version=req.version,
            mode=req.mode,
            phase=UpdatePhase.DRAINING,
            started_at=_stamp(self.clock),
        )
        self._tasks[req.id] = asyncio.create_task(self._run(req))
        return web.json_response(self.updates[req.id].to_wire(), status=202)

    async def _get(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "unauthorized", "missing or wrong bearer token")
        update = self.updates.get(request.match_info["id"])
        if update is None:
            return self._error(404, "not_found", f"no update {request.match_info['id']}")
        return web.json_response(update.to_wire())

    async def _abort(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "unauthorized", "missing or wrong bearer token")
        uid = request.match_info["id"]
        if uid not in self.updates:
            return self._error(404, "not_found", f"no update {uid}")
        task = self._tasks.get(uid)
        record = self.updates[uid]
        if self.scripts.get(record.version) == "race" and not record.phase.terminal:
            if task is not None:
                task.cancel()
            req = self.requests[uid]  # committed just before the abort arrived
            self.version = req.version
            self.source, self.manifest = req.source.uri, req.source.manifest
            self._finish(uid, UpdatePhase.COMMITTED, [])
        if self.updates[uid].phase is UpdatePhase.COMMITTED:
            return self._error(409, "conflict", f"update {uid!r} already committed; roll back")
        if task is not None and not task.done():
            task.cancel()
            self._finish(uid, UpdatePhase.ABORTED, ["aborted by the operator"])
        return web.json_response(self.updates[uid].to_wire())

    # ---- the simulated update ------------------------------------------------------------------

    def _set(self, uid: str, phase: UpdatePhase) -> None:
        self.updates[uid] = self.updates[uid].model_copy(update={"phase": phase})

    def _finish(self, uid: str, phase: UpdatePhase, reasons: list[str]) -> None:
        committed = phase is UpdatePhase.COMMITTED
        self.updates[uid] = self.updates[uid].model_copy(
            update={"phase": phase, "verdict": Verdict(committed=committed, reasons=reasons)}
        )
        self.active = None
        if committed:
            self.paused = False
            self.engine = EngineState.CLEAN
            self.hold = None
            self.committed_version, self.committed_id = self.updates[uid].version, uid
            self.commit_gone = False
        else:
            # fail closed: stay paused, held, not ready
            self.engine = EngineState.POISONED
            self.hold = f"{phase.value.lower()}: update {uid} did not commit"

    async def _run(self, req: UpdateRequest) -> None:
        script = self.scripts.get(req.version, "succeed")
        uid = req.id
        await asyncio.sleep(self.step)
        self._set(uid, UpdatePhase.LOADING)
        self.engine = EngineState.DIRTY
        await asyncio.sleep(self.step)
        if script in ("hang", "race"):
            await asyncio.Event().wait()
        self._set(uid, UpdatePhase.VERIFYING)
        await asyncio.sleep(self.step)
        if script == "fail":
            self._finish(uid, UpdatePhase.FAILED, ["DigestMismatch: rank tp1 digest differs"])
            return
        self.version = req.version
        self.source, self.manifest = req.source.uri, req.source.manifest
        self._finish(uid, UpdatePhase.COMMITTED, [])

    @property
    def runs(self) -> list[str]:
        """``executions`` without the WeightUpdate uid and generation: ``wu-v2-a1`` (first
        attempt at v2), ``wu-v1-a2-rb`` (second attempt, a rollback to v1)."""
        return [_ATTEMPT.sub("", uid) for uid in self.executions]

    def update_of(self, run: str) -> UpdateStatus:
        """The record of the update whose :attr:`runs` entry is ``run``."""
        return next(u for i, u in self.updates.items() if _ATTEMPT.sub("", i) == run)

    def snapshot(self) -> dict[str, Any]:
        """What the agent would say right now (used by the pod-status write log)."""
        return {
            "version": self.version,
            "source": self.source,
            "ready": self.ready,
            "engine": self.engine.value,
            "committed_id": self.committed_id,
        }


@dataclass
class FakeFleetAgents:
    """Agents for a fleet of fake pods: ``pod-0`` on 127.0.0.2, ``pod-1`` on 127.0.0.3, …"""

    port: int = field(default_factory=free_port)
    token: str | None = None
    agents: dict[str, FakeAgent] = field(default_factory=dict)
    #: The clock every agent added from now on keeps (see :attr:`FakeAgent.clock`).
    clock: Callable[[], datetime] = _wall_clock

    async def add(self, pod: str, index: int, **kw: Any) -> FakeAgent:
        kw.setdefault("clock", self.clock)
        agent = FakeAgent(
            pod=pod, host=f"127.0.0.{index + 2}", port=self.port, token=self.token, **kw
        )
        await agent.appear()
        self.agents[pod] = agent
        return agent

    def __getitem__(self, pod: str) -> FakeAgent:
        return self.agents[pod]

    async def close(self) -> None:
        for agent in self.agents.values():
            await agent.close()
