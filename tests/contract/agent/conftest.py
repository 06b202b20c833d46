"""Fixtures for the sidecar's contract tests: a fake vLLM (test double) and an in-process agent.

The agent under test is the real one (``engine_agent.sidecar``) serving real HTTP on a random
loopback port; only vLLM is replaced, by ``tests/harness/fake_vllm.py``. Tests talk to the agent
over HTTP, never through its Python API, so they check the contract the operator relies on.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import ClientResponse, ClientSession
from aiohttp.test_utils import TestServer
from safetensors.numpy import save_file

_ROOT = Path(__file__).resolve().parents[3]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from engine_agent.manifest import build_manifest, write_manifest  # noqa: E402
from engine_agent.sidecar import Agent, AgentConfig, TokenFile, create_app  # noqa: E402
from tests.harness.fake_vllm import FakeVllm  # noqa: E402

TOKEN = "s3cret-token"


def make_checkpoint(root: Path, name: str, seed: int, *, version: str | None = None) -> Path:
    """Write a tiny two-file safetensors checkpoint and its manifest; return the directory."""
    rng = np.random.default_rng(seed)
    out = root / name
    out.mkdir(parents=True)
    save_file(
        {"model.embed_tokens.weight": rng.standard_normal((32, 16), dtype=np.float32)},
        str(out / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"lm_head.weight": rng.standard_normal((32, 16), dtype=np.float32)},
        str(out / "model-00002-of-00002.safetensors"),
    )
    write_manifest(build_manifest(out, version=version), out / "manifest.json")
    return out


@dataclass
class AgentHarness:
    """The agent under test, its HTTP base URL and a token-carrying client."""

    agent: Agent
    server: TestServer
    http: ClientSession
    fake: FakeVllm
    token: str = TOKEN
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    async def get(self, path: str, **kwargs: Any) -> ClientResponse:
        kwargs.setdefault("headers", self.headers())
        return await self.http.get(self.url + path, **kwargs)

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> ClientResponse:
        kwargs.setdefault("headers", self.headers())
        return await self.http.post(self.url + path, json=body, **kwargs)

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.post("/v1/updates", body)
        assert response.status == 202, await response.text()
        result: dict[str, Any] = await response.json()
        return result

    async def wait_phase(self, update_id: str, *phases: str, timeout: float = 10) -> dict[str, Any]:
        phases = phases or ("Committed", "Failed", "Aborted")
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            response = await self.get(f"/v1/updates/{update_id}")
            status: dict[str, Any] = await response.json()
            if status["phase"] in phases:
                return status
            assert loop.time() < end, f"update stuck in {status['phase']}: {status}"
            await asyncio.sleep(0.02)

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        # with the token: an anonymous /readyz (the kubelet's) does not say why
        response = await self.http.get(self.url + "/readyz", headers=self.headers())
        return response.status, await response.json()

    async def wait_ready(self, want: bool = True, timeout: float = 10) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            status, body = await self.readyz()
            if (status == 200) == want:
                return body
            assert loop.time() < end, f"readyz stayed {status}: {body}"
            await asyncio.sleep(0.05)


def update_body(update_id: str, version: str, source: Path, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": update_id,
        "version": version,
        "source": {"uri": f"file://{source}"},
        "drain": {"mode": "wait", "timeoutSeconds": 5},
    }
    body.update(extra)
    return body


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def checkpoints(tmp_path: Path) -> dict[str, Path]:
    return {
        "v1": make_checkpoint(tmp_path / "ckpt", "v1", 1, version="v1"),
        "v2": make_checkpoint(tmp_path / "ckpt", "v2", 2, version="v2"),
    }


@pytest.fixture
def fake_ranks() -> int:
    """World size of the fake vLLM; override with ``@pytest.mark.parametrize``."""
    return 1


@pytest_asyncio.fixture
async def fake(fake_ranks: int) -> AsyncIterator[FakeVllm]:
    server = FakeVllm.tp(fake_ranks)
    await server.start()
    yield server
    await server.stop()


def agent_config(fake: FakeVllm, state_dir: Path, **overrides: Any) -> AgentConfig:
    settings: dict[str, Any] = dict(
        vllm_url=fake.url,
        begin_timeout=2.0,
        load_timeout=2.0,
        finish_timeout=1.0,
        control_timeout=2.0,
        abort_pause_timeout=2.0,
        watch_interval=0.05,
        observe_ttl=0.0,
        state_dir=state_dir,
    )
    settings.update(overrides)
    return AgentConfig(**settings)


async def start_harness(
    fake: FakeVllm, token_file: Path, state_dir: Path, **overrides: Any
) -> AgentHarness:
    agent = Agent(agent_config(fake, state_dir, **overrides))
    server = TestServer(create_app(agent, TokenFile(token_file)), host="127.0.0.1")
    await server.start_server()
    harness = AgentHarness(agent, server, ClientSession(), fake)
    await asyncio.wait_for(agent._recovered.wait(), 10)
    return harness


async def stop_harness(harness: AgentHarness) -> None:
    await harness.http.close()
    await harness.server.close()


@pytest_asyncio.fixture
async def harness(fake: FakeVllm, token_file: Path, tmp_path: Path) -> AsyncIterator[AgentHarness]:
    h = await start_harness(fake, token_file, tmp_path / "state")
    yield h
    await stop_harness(h)
