"""The server tier's vLLM servers, shared by its modules: a session-wide pool and its reset.

Where a start goes (a TP=1 start, its log, an idle 2-core machine): 25 s, of which ~8 s each for
the API server, the engine core and the worker (one more per extra TP rank) to import torch and
vLLM in their own spawned processes (vLLM forces ``spawn`` on CPU), and under one second for the
engine itself (weights, KV cache, profile and warm-up run: "init engine ... took 0.58 s"). Under
CI load a start took 60-120 s. No server flag shrinks the imports, so the tier starts fewer
servers instead, and starts those it needs together two at a time (two cores; one start keeps
about one core busy).

* A :class:`Flavour` is what a server boots: a model family and a TP size. Every pooled server
  runs the same flags (:data:`POOL_ARGS`, :data:`POOL_ENV`: the Gloo weight-transfer backend and
  the trainer network), so one server takes file updates and trainer pushes alike.
* Slot 0 of each flavour lives for the session (unless its only module releases it with
  ``keep=False``); a module that needs more replicas at once (the fleet) gets further slots,
  stopped again when it releases them.
* A module's server may be one that an earlier module restarted, or restarted onto another
  checkpoint with the same flags (``test_agent_tp1`` boots B under its agent): what it boots is
  never relied on. :meth:`Replica.restart` always boots the flavour's checkpoint A labelled v0.
* Cold outputs (the differential oracles) are the completions of a fresh engine on a checkpoint,
  kept per flavour and checkpoint for the session: A's from the pooled server straight after its
  first boot, before any agent or update touched it; another checkpoint's from a server started
  for it and stopped at once, or recorded by a module that booted one anyway
  (:meth:`ServerPool.record_cold`).
* The reset, at every acquire (``conftest.attach``): a server that is gone or does not answer
  ``/health`` is started again; failpoints are cleared; the module's agent starts with an empty
  state directory; a full update to A labelled v0 commits; then the replica must be ready,
  clean, unpaused, at v0, and serve exactly the cold outputs of A. So a module starts from the
  same state whether it runs alone or after any other, in any order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tests.server.vllm_server import VllmServer, complete

#: Prompts of every output comparison in the tier.
PROMPTS = ("Weights are reloaded", "The quick brown fox", "in place.")
#: The trainer runs on this machine: its rendezvous (loopback) is the one trainer network,
#: for the agent (``--trainer-networks``) and for every worker (the vLLM container's variable).
TRAINER_NETWORKS = "127.0.0.1/32"
POOL_ARGS = ("--weight-transfer-config", json.dumps({"backend": "weightroll_gloo"}))
POOL_ENV = {"WEIGHTROLL_TRAINER_NETWORKS": TRAINER_NETWORKS}
#: Starts at once: one start keeps about one core busy, and the machine has two.
CONCURRENT_STARTS = 2

Outputs = list[tuple[str, list[float]]]


async def outputs_of(
    http: aiohttp.ClientSession, server: VllmServer, max_tokens: int = 8
) -> Outputs:
    """Greedy text and token logprobs of :data:`PROMPTS`, one request at a time."""
    result = []
    for prompt in PROMPTS:
        choice = await complete(http, server.url, str(server.model), prompt, max_tokens)
        result.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return result


@dataclass
class Models:
    """A model family's boot checkpoint ``a`` and full updates ``b``, ``c`` (each with its
    manifest), under ``root``; shared read-only by every module (write copies elsewhere)."""

    root: Path
    a: Path
    b: Path
    c: Path


@dataclass(frozen=True)
class Flavour:
    """What a pooled server boots: ``build(root)`` writes the family's checkpoints."""

    name: str
    tp: int
    build: Callable[[Path], Models] = field(compare=False, hash=False)


@dataclass
class Replica:
    """One pooled server slot: its port, log and failpoints file stay across restarts."""

    flavour: Flavour
    models: Models
    root: Path
    server: VllmServer
    failpoints: Path

    def canonical(self) -> VllmServer:
        """The flavour's server on this slot's port: checkpoint A, labelled v0."""
        return VllmServer(
            model=self.models.a,
            log=self.root / "vllm.log",
            tp=self.flavour.tp,
            boot_version="v0",
            failpoints_file=self.failpoints,
            port=self.server.port,
            extra_args=list(POOL_ARGS),
            extra_env=dict(POOL_ENV),
        )

    def booted_on(self, checkpoint: Path, label: str) -> VllmServer:
        """This slot's server booted on ``checkpoint`` labelled ``label`` (not started)."""
        return dataclasses.replace(
            self.canonical(), model=checkpoint, boot_version=label, process=None
        )

    async def restart(self) -> None:
        """Stop whatever runs on the slot and boot checkpoint A labelled v0 on its port."""
        await self.server.stop()
        self.server = self.canonical()
        await self.server.start()

    async def healthy(self, http: aiohttp.ClientSession) -> bool:
        process = self.server.process
        if process is None or process.returncode is not None:
            return False
        try:
            timeout = aiohttp.ClientTimeout(total=10)
            response = await http.get(f"{self.server.url}/health", timeout=timeout)
        except (aiohttp.ClientError, TimeoutError):
            return False
        return response.status == 200


class ServerPool:
    """The session's servers (module doc). Used from one event loop: the session's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._checkpoints: dict[Flavour, Models] = {}
        self._replicas: dict[Flavour, list[Replica]] = {}
        self._cold: dict[tuple[Flavour, Path], Outputs] = {}
        self._starts = asyncio.Semaphore(CONCURRENT_STARTS)
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    def checkpoints(self, flavour: Flavour) -> Models:
        """The family's checkpoints, built once per session (TP sizes share them)."""
        for known, built in self._checkpoints.items():
            if known.build is flavour.build:
                return built
        built = flavour.build(self.root / f"models-{flavour.name}")
        self._checkpoints[flavour] = built
        return built

    async def start(self, server: VllmServer) -> None:
        """Start ``server``, at most :data:`CONCURRENT_STARTS` at a time."""
        async with self._starts:
            await server.start()

    async def acquire(
        self, flavour: Flavour, count: int = 1, *, cold: Sequence[Path] = ()
    ) -> list[Replica]:
        """``count`` running servers of ``flavour`` (not yet reset), and the cold outputs of
        each checkpoint in ``cold`` recorded; every start needed runs concurrently."""
        checkpoints = self.checkpoints(flavour)
        replicas = self._replicas.setdefault(flavour, [])
        while len(replicas) < count:
            slot = self.root / f"{flavour.name}-{len(replicas)}"
            slot.mkdir(parents=True, exist_ok=True)
            failpoints = slot / "failpoints"
            failpoints.write_text("")
            placeholder = VllmServer(model=checkpoints.a, log=slot / "vllm.log")
            replicas.append(Replica(flavour, checkpoints, slot, placeholder, failpoints))
        chosen = replicas[:count]
        for replica in chosen:
            replica.failpoints.write_text("")
        await asyncio.gather(
            *(self._ensure_running(r) for r in chosen),
            *(self._record_cold(flavour, c) for c in cold if c != checkpoints.a),
        )
        return chosen

    async def _ensure_running(self, replica: Replica) -> None:
        if await replica.healthy(self.http):
            return
        await replica.server.stop()
        replica.server = replica.canonical()
        await self.start(replica.server)
        key = (replica.flavour, replica.models.a)
        if key not in self._cold:  # a fresh engine on A, before anyone touched it
            self._cold[key] = await outputs_of(self.http, replica.server)

    async def _record_cold(self, flavour: Flavour, checkpoint: Path) -> None:
        if (flavour, checkpoint) in self._cold:
            return
        server = VllmServer(
            model=checkpoint,
            log=self.root / f"cold-{flavour.name}-{checkpoint.name}.log",
            tp=flavour.tp,
            boot_version="cold",
            extra_args=list(POOL_ARGS),
            extra_env=dict(POOL_ENV),
        )
        try:
            await self.start(server)
            self._cold[(flavour, checkpoint)] = await outputs_of(self.http, server)
        finally:
            await server.stop()

    def cold(self, flavour: Flavour, checkpoint: Path) -> Outputs:
        """The outputs of a fresh engine of ``flavour`` on ``checkpoint`` (acquired with it)."""
        return self._cold[(flavour, checkpoint)]

    def record_cold(self, flavour: Flavour, checkpoint: Path, outputs: Outputs) -> None:
        """A module booted a fresh engine of ``flavour`` on ``checkpoint`` (same flags): keep
        its outputs as that checkpoint's oracle, unless one is kept already."""
        self._cold.setdefault((flavour, checkpoint), outputs)

    async def release(self, replicas: Sequence[Replica], *, keep: bool = True) -> None:
        """Slot 0 stays (running or not: the next acquire checks) unless ``keep`` is false
        (a flavour no later module uses: ~2.7 GiB of RSS for a TP=1 server); further slots
        stop."""
        for replica in replicas:
            replica.failpoints.write_text("")
            pool = self._replicas[replica.flavour]
            if pool.index(replica) > 0 or not keep:
                await replica.server.stop()

    async def close(self) -> None:
        for replicas in self._replicas.values():
            await asyncio.gather(*(r.server.stop() for r in replicas))
        if self._http is not None:
            await self._http.close()
