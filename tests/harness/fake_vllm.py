"""TEST DOUBLE: a fake vLLM OpenAI server with scriptable ranks, for the sidecar's contract tests.

This is **not** vLLM. It serves the few dev-mode routes the sidecar uses (``/health``,
``/get_world_size``, ``/pause``, ``/resume``, ``/is_paused``, ``/reset_prefix_cache``,
``/collective_rpc``, ``/metrics``, ``/weight_info``, ``/update_weight_version``,
``/init_weight_transfer_engine`` (recorded only)) plus a toy ``/v1/completions``, and plays N
ranks of the
weightroll worker extension with the real state machine of ``engine_agent/reload/session.py``
(clean → open → dirty → clean(v'), dirty --abort--> poisoned; a delta's base checks).

Scriptable per rank (:class:`FakeRank`): fail a method with an error code, hang in a method,
omit or duplicate its result, report another update id, coverage hash or an identity problem.
Scriptable per server: hold a method at a gate (to act mid-update), slow generation (to test
draining), restart (all ranks back to the boot version, unpaused).

Loading is realistic enough for the contract: the path must exist, and when a manifest is given
each rank compares the checkpoint on disk with it (``engine_agent.manifest``), failing with
``manifest_mismatch`` as the real extension does. Like the real extension, a rank's ``digest``
is ``rank_digest`` over the content hashes of the tensors it read (the manifest's algorithm,
else BLAKE3), so with a manifest it equals ``Manifest.rank_digest()``; a partial or sparse
``begin`` needs ``clean`` at exactly ``baseVersion`` and ``baseUpdateId``; ``abort {poison:
true}`` poisons a clean rank too.
vLLM's own weight version (``/weight_info``) starts as ``"default"`` and resets on restart.

Completions answer ``"weights=<version>"`` with the version the ranks held when the request
was admitted, or ``"mixed"`` if it changed while the request ran, so tests can prove that no
request is served by mixed weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from engine_agent.errors import (
    AgentError,
    CoverageIncomplete,
    InvalidRequest,
    ManifestMismatch,
    SourceUnavailable,
    WrongState,
)
from engine_agent.manifest import ManifestError, build_manifest, load_manifest
from engine_agent.protocol import PrefetchArgs, UpdateMode, UpdateSpec
from engine_agent.reload import session
from engine_agent.reload.session import WeightState
from engine_agent.transfer.rendezvous import (
    WORKER_ENV,
    WORKER_SETTING,
    RendezvousRefused,
    check_init_info,
    networks_from_env,
)

__all__ = ["FakeRank", "FakeVllm"]


@dataclass
class FakeRank:
    """One fake rank of the worker extension.

    Its weight state is the real one: :mod:`engine_agent.reload.session`'s ``WeightState``,
    moved by the same transitions the extension uses (begin with its base checks, the first
    write, commit, fail, abort, poison), so the fake answers every state question as a real
    rank does. What it fakes is the model: loading only checks files and manifests.
    """

    dp: int = 0
    pp: int = 0
    tp: int = 0
    ep: int = 0
    ws: WeightState = field(default_factory=lambda: session.initial("v0"))
    #: method -> error code: the rank answers ``ok: false`` with that code.
    fail: dict[str, str] = field(default_factory=dict)
    #: methods in which this rank never answers.
    hang: set[str] = field(default_factory=set)
    #: methods whose result from this rank is dropped from ``results``.
    missing: set[str] = field(default_factory=set)
    #: methods whose result from this rank appears twice.
    duplicate: set[str] = field(default_factory=set)
    #: finish reports this coverage hash instead of the common one.
    coverage_hash: str | None = None
    #: finish reports these identity problems.
    identity_problems: list[str] = field(default_factory=list)
    #: report this update id instead of the session's.
    wrong_update_id: str | None = None
    #: finish reports this digest instead of the one of the bytes read.
    digest: str | None = None
    #: ``False``: ``weightroll_state`` has no ``committedUpdateId``, as a worker extension of an
    #: earlier weightroll release (before ranks kept their commit's id) answers.
    reports_commit: bool = True
    source_digest: str = ""
    manifest_digest: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    loaded_bytes: int = 0
    #: The rank's ``WEIGHTROLL_TRAINER_NETWORKS``: ``weightroll_transfer_check_init`` runs the
    #: real check (``engine_agent.transfer.rendezvous``) against it.
    trainer_networks: str = "127.0.0.1/32"
    #: The prefetched update: its spec, manifest digest, content digest and staged bytes.
    staged: tuple[UpdateSpec, str, str, int] | None = None

    @property
    def rank(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "ep": self.ep}

    @property
    def state(self) -> str:
        return self.ws.state.value

    @property
    def version(self) -> str:
        return self.ws.version

    @property
    def update_id(self) -> str | None:
        return self.ws.update_id

    @property
    def committed_by(self) -> str | None:
        """The session whose commit produced what the rank serves (``None``: boot weights)."""
        return self.ws.committed_by

    def reset(self, version: str) -> None:
        """A (re)started engine: clean at its boot weights, no commit of its own."""
        self.ws = session.initial(version)
        self.loaded_bytes = 0
        self.manifest_digest = ""
        self.source_digest = ""
        self.staged = None

    def _report(
        self, call: str, ok: bool = True, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "call": call,
            "ok": ok,
            "state": self.state,
            "version": self.version,
            "updateId": self.wrong_update_id or self.update_id,
            "error": error,
            "bytesLoaded": self.loaded_bytes if call == "load" else 0,
        }

    def _failed(self, call: str, error: AgentError) -> dict[str, Any]:
        """As ``RankEngine._failed``: a failed load or finish ends the session (a rank that
        wrote is poisoned, one that did not stays at its version)."""
        if call in ("load", "apply", "finish") and self.ws.in_session:
            self.ws = session.fail(self.ws, f"{call} failed: {error.message}")
        return self._report(call, ok=False, error={"code": error.code, "message": error.message})

    def handle(self, method: str, arg: str) -> Any:
        """Run one extension method; returns the rank's result dict."""
        self.calls.append((method, arg))
        call = method.removeprefix("weightroll_")
        if method in self.fail:
            scripted = AgentError(f"scripted failure of {method} on tp{self.tp}")
            scripted.code = self.fail[method]
            return self._failed(call, scripted)
        if method == "weightroll_state":
            return {
                "rank": self.rank,
                "state": self.state,
                "version": self.version,
                "updateId": self.update_id,
                "servingSafe": self.ws.serving_safe,
                "poisonReason": self.ws.poison_reason,
                **({"committedUpdateId": self.committed_by} if self.reports_commit else {}),
            }
        if method == "weightroll_transfer_check_init":
            networks = networks_from_env({WORKER_ENV: self.trainer_networks})
            try:
                check_init_info(json.loads(arg), networks, setting=WORKER_SETTING)
            except RendezvousRefused as e:
                return self._report("transfer", ok=False, error={"code": e.code, "message": str(e)})
            return self._report("check_init")
        try:
            if method == "weightroll_begin":
                return self._begin(arg)
            if method == "weightroll_load":
                return self._load(json.loads(arg))
            if method == "weightroll_finish":
                return self._finish()
            if method == "weightroll_abort":
                return self._abort(json.loads(arg))
            if method == "weightroll_prefetch":
                return self._prefetch(arg)
            if method == "weightroll_prefetched":
                return self._prefetched()
            if method == "weightroll_apply":
                return self._apply()
        except AgentError as e:
            return self._failed(call, e)
        raise web.HTTPBadRequest(text=f"unknown method {method}")

    def _begin(self, arg: str) -> dict[str, Any]:
        try:
            spec = UpdateSpec.model_validate_json(arg)
        except ValidationError as e:
            raise InvalidRequest(f"spec: {e.errors()[0]['msg']}") from e
        if self.ws.in_session:
            # As the real rank (reload/engine.py): the same id and spec is acknowledged, any
            # other begin (the same id with another spec included) is a conflict.
            session.begin(self.ws, spec)
            return self._report("begin")
        self.ws = session.begin(self.ws, spec)
        self.manifest_digest = ""
        self.loaded_bytes = 0
        return self._report("begin")

    def _load(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.ws.in_session:
            raise WrongState(f"no update session is open (engine is {self.state})")
        self.manifest_digest, self.source_digest, self.loaded_bytes = self._read(body)
        if self.ws.state.value == "open":
            self.ws = session.mark_written(self.ws)
        return self._report("load")

    def _prefetch(self, arg: str) -> dict[str, Any]:
        """As ``RankPrefetch._prefetch_start`` (``reload/rank_prefetch.py``): the session checks
        (``session.prefetch``), then the read and its manifest check; the rank stays clean at its
        version, serving."""
        args = PrefetchArgs.model_validate_json(arg)
        if self.staged is not None and self.staged[0] == args.spec:
            return self._staging_report("prefetch")  # a retried call
        prefetched = session.prefetch(self.ws, args.spec)
        read = self._read(args.source.model_dump(by_alias=True))
        self.staged, self.ws = (args.spec, *read), prefetched
        return self._staging_report("prefetch")

    def _prefetched(self) -> dict[str, Any]:
        if self.staged is None or self.ws.prefetched != self.staged[0].update_id:
            raise WrongState("no prefetch is held on this rank (aborted, or the rank restarted)")
        return self._staging_report("prefetched")

    def _apply(self) -> dict[str, Any]:
        if not self.ws.in_session:
            raise WrongState(f"no update session is open (engine is {self.state})")
        if self.staged is None or self.staged[0].update_id != self.ws.update_id:
            raise WrongState(f"update {self.ws.update_id} has no prefetched checkpoint ready")
        _, self.manifest_digest, self.source_digest, self.loaded_bytes = self.staged
        self.staged, self.ws = None, session.drop_prefetch(self.ws)
        self.ws = session.mark_written(self.ws)
        report = self._report("apply")
        report["bytesLoaded"] = self.loaded_bytes
        return report

    def _staging_report(self, call: str) -> dict[str, Any]:
        assert self.staged is not None
        spec, _, _, staged_bytes = self.staged
        report = self._report(call)
        report.update(
            {"updateId": spec.update_id, "prefetch": "ready", "stagedBytes": staged_bytes}
        )
        return report

    def _read(self, body: dict[str, Any]) -> tuple[str, str, int]:
        """Check a checkpoint as the rank's read does: its manifest digest, the content digest
        and its bytes; raises the rank's error codes."""
        manifest_digest = ""
        path = body["path"]
        if not os.path.exists(path):
            raise SourceUnavailable(f"{path} does not exist")
        if body.get("manifest"):
            try:
                # as the real rank (reload/engine.py): the update's pin, checked on these bytes
                pinned = load_manifest(body["manifest"], pinned=body.get("manifestDigest"))
                actual = build_manifest(path)
            except ManifestError as e:
                error = AgentError(str(e))
                error.code = e.code
                raise error from e
            if pinned.algorithm != actual.algorithm:
                actual = build_manifest(path, algorithm=pinned.algorithm)
            if pinned.digest != actual.digest:
                raise ManifestMismatch("checkpoint bytes differ from the manifest")
            manifest_digest = pinned.digest
        else:
            try:
                actual = build_manifest(path)
            except ManifestError as e:
                raise SourceUnavailable(str(e)) from e
        files = (
            [path]
            if os.path.isfile(path)
            else [
                os.path.join(path, name)
                for name in os.listdir(path)
                if name.endswith(".safetensors")
            ]
        )
        return manifest_digest, actual.rank_digest(), sum(os.path.getsize(n) for n in files)

    def _finish(self) -> dict[str, Any]:
        if not self.ws.in_session:
            raise WrongState(f"no update session is open (engine is {self.state})")
        if self.ws.state.value == "open":  # nothing written: as the extension's ledger says
            if self.ws.mode is UpdateMode.SPARSE:
                raise WrongState("no weights were loaded in this session; nothing to commit")
            raise CoverageIncomplete("nothing was loaded")
        update_id, target = self.ws.update_id, self.ws.target_version
        self.ws = session.commit(self.ws)
        report = self._report("finish")
        report.update(
            {
                "updateId": self.wrong_update_id or update_id,
                "required": 21,
                "received": 21,
                "coverageHash": self.coverage_hash or f"cov-{target}",
                "digest": self.digest or self.source_digest,
                "sourceDigest": self.source_digest,
                "identityOk": not self.identity_problems,
                "identityProblems": self.identity_problems,
                "manifestDigest": self.manifest_digest,
            }
        )
        return report

    def _abort(self, body: dict[str, Any]) -> dict[str, Any]:
        self.staged, self.ws = None, session.drop_prefetch(self.ws)  # staging is always freed
        if body.get("poison"):
            self.ws = session.poison(self.ws, body.get("reason") or "poisoned by the coordinator")
        elif self.ws.in_session:
            self.ws = session.abort(self.ws)
        return self._report("abort")


class FakeVllm:
    """TEST DOUBLE of a vLLM OpenAI server in dev mode with N fake ranks.

    Args:
        ranks: the ranks (default: one rank at ``boot_version``).
        boot_version: version every rank reports after start or :meth:`restart`.
        gen_seconds: how long one completion takes.
    """

    def __init__(
        self,
        ranks: list[FakeRank] | None = None,
        *,
        boot_version: str = "v0",
        gen_seconds: float = 0.05,
    ) -> None:
        self.boot_version = boot_version
        self.ranks = ranks or [FakeRank()]
        for rank in self.ranks:
            rank.reset(boot_version)
        self.gen_seconds = gen_seconds
        self.paused = False
        self.running = 0
        self.gates: dict[str, asyncio.Event] = {}
        #: vLLM's engine core runs utility calls one at a time; so does the fake.
        self._rpc_lock = asyncio.Lock()
        self.entered: dict[str, asyncio.Event] = {}
        self.requests: list[tuple[str, str]] = []
        #: Bodies of ``/init_weight_transfer_engine`` (vLLM's trainer rendezvous) that arrived.
        self.transfer_inits: list[Any] = []
        self.cache_resets = 0
        self.cache_reset_ok = True
        self.restarts = 0
        #: vLLM's own weight version (``/weight_info``); ``"default"`` after (re)start.
        self.weight_version = "default"
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborted = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hang_forever = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @classmethod
    def tp(cls, size: int, **kwargs: Any) -> FakeVllm:
        return cls([FakeRank(tp=i) for i in range(size)], **kwargs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def version(self) -> str:
        versions = {rank.version for rank in self.ranks}
        return versions.pop() if len(versions) == 1 else "mixed"

    def calls(self, method: str) -> int:
        return sum(1 for rank in self.ranks for name, _ in rank.calls if name == method)

    def gate(self, method: str) -> asyncio.Event:
        """Hold ``method`` until the returned event is set; ``entered[method]`` fires on arrival."""
        self.gates[method] = asyncio.Event()
        self.entered[method] = asyncio.Event()
        return self.gates[method]

    # ---------------------------------------------------------------- lifecycle

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_world_size", self._world_size)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_post("/reset_prefix_cache", self._reset_cache)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_post("/init_weight_transfer_engine", self._init_transfer)
        return app

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self._app(), shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        server = site._server
        assert server is not None and hasattr(server, "sockets")
        self.port = server.sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        self._hang_forever.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._hang_forever = asyncio.Event()

    async def restart(self, down_seconds: float = 0.0) -> None:
        """Simulate vLLM restarting underneath the agent: same port, boot weights, unpaused."""
        await self.stop()
        await asyncio.sleep(down_seconds)
        for rank in self.ranks:
            rank.reset(self.boot_version)
        self.paused = False
        self._resumed.set()
        self.restarts += 1
        self.weight_version = "default"
        await self.start(self.port)

    # ---------------------------------------------------------------- routes

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _world_size(self, _: web.Request) -> web.Response:
        return web.json_response({"world_size": len(self.ranks)})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            self._aborted.set()
            await self._idle.wait()
            self._aborted.clear()
        elif mode == "wait":
            await self._idle.wait()
        return web.json_response({"status": "paused"})

    async def _resume(self, _: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _reset_cache(self, _: web.Request) -> web.Response:
        self.cache_resets += 1
        return web.json_response({"success": self.cache_reset_ok})

    async def _weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):  # FastAPI's answer to a missing body field
            return web.json_response({"detail": [{"loc": ["body", "new_version"]}]}, status=422)
        self.weight_version = version
        return web.json_response({"success": True, "new_version": version})

    async def _init_transfer(self, request: web.Request) -> web.Response:
        """Records the rendezvous; a real worker would now connect to ``master_address``."""
        self.transfer_inits.append(await request.json())
        return web.json_response({"message": "Weight transfer initialized"})

    async def _metrics(self, _: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {float(self.running)}\n'
        )
        return web.Response(text=text)

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method, args, timeout = body["method"], body.get("args", []), body.get("timeout")
        if not all(isinstance(arg, str) for arg in args):
            return web.json_response({"error": "args must be strings"}, status=400)
        arg = args[0] if args else "{}"
        async with self._rpc_lock:
            return await self._rpc_locked(method, arg, timeout)

    async def _rpc_locked(self, method: str, arg: str, timeout: float | None) -> web.Response:
        if method in self.entered:
            self.entered[method].set()
        if method in self.gates:
            await self.gates[method].wait()
        results: list[Any] = []
        hung = False
        for rank in self.ranks:
            if method in rank.hang:
                hung = True
                rank.calls.append((method, arg))
                continue
            result = rank.handle(method, arg)
            if method in rank.missing:
                continue
            results.append(result)
            if method in rank.duplicate:
                results.append(result)
        if hung:
            if timeout is None:
                await self._hang_forever.wait()
            else:
                await asyncio.sleep(float(timeout))
            return web.json_response({"error": f"RPC call to {method} timed out."}, status=500)
        return web.json_response({"results": results})

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self._resumed.wait()
        self.running += 1
        self._idle.clear()
        start_version = self.version
        finish_reason = "length"
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._aborted.wait(), self.gen_seconds)
                finish_reason = "abort"
        finally:
            self.running -= 1
            if self.running == 0:
                self._idle.set()
        end_version = self.version
        text = f"weights={start_version}" if start_version == end_version else "mixed"
        self.requests.append((str(body.get("prompt", "")), text))
        return web.json_response(
            {
                "choices": [
                    {
                        "text": text if finish_reason != "abort" else "",
                        "finish_reason": finish_reason,
                    }
                ]
            }
        )
