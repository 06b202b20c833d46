"""Shared pieces of the trainer-path server tests: servers with ``weightroll_gloo``, a trainer.

A replica is a real vLLM server (``--weight-transfer-config '{"backend":"weightroll_gloo"}'``)
plus a real ``weightroll agent``; the trainer is ``tests/server/trainer_proc.py`` in its own
process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.server.conftest import PROMPTS, TOKEN
from tests.server.vllm_server import ROOT, AgentProcess, VllmServer, complete

GLOO = ["--weight-transfer-config", json.dumps({"backend": "weightroll_gloo"})]


@dataclass
class Replica:
    server: VllmServer
    agent: AgentProcess

    @property
    def url(self) -> str:
        return self.agent.url


async def start_replica(
    root: Path, model: Path, token: Path, *, tp: int = 1, failpoints: Path | None = None
) -> Replica:
    server = VllmServer(
        model=model,
        log=root / "vllm.log",
        tp=tp,
        boot_version="v0",
        extra_args=list(GLOO),
        failpoints_file=failpoints,
    )
    await server.start()
    agent = AgentProcess(
        server.url,
        token,
        root / "agent-state",
        root / "agent.log",
        extra=["--watch-interval", "0.5", "--finish-timeout", "60", "--load-timeout", "120"],
    )
    await agent.start()
    return Replica(server, agent)


async def stop_replica(replica: Replica) -> None:
    await replica.agent.stop()
    await replica.server.stop()


async def run_trainer(
    agents: list[str],
    token: Path,
    checkpoint: Path,
    version: str,
    shape: str = "full",
    hold_file: Path | None = None,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """Run the trainer process; return its per-replica results."""
    argv = [
        sys.executable,
        str(ROOT / "tests" / "server" / "trainer_proc.py"),
        "--token-file",
        str(token),
        "--checkpoint",
        str(checkpoint),
        "--version",
        version,
        "--shape",
        shape,
    ]
    for agent in agents:
        argv += ["--agent", agent]
    if hold_file is not None:
        argv += ["--hold-file", str(hold_file)]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode == 0, err.decode()[-3000:]
    results: list[dict[str, Any]] = json.loads(out)
    return results


async def outputs(http: aiohttp.ClientSession, server: VllmServer) -> list[tuple[str, list[float]]]:
    result = []
    for prompt in PROMPTS:
        choice = await complete(http, server.url, str(server.model), prompt, 8)
        result.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return result


async def call(
    http: aiohttp.ClientSession, url: str, route: str, body: Any = None, token: str = TOKEN
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"}
    if route == "/weight_info":
        response = await http.get(f"{url}{route}", headers=headers)
    else:
        response = await http.post(
            f"{url}{route}", json=body if body is not None else {}, headers=headers
        )
    return response.status, await response.json()


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    response = await http.get(f"{url}/readyz")
    return response.status, await response.json()


async def wait_ready(
    http: aiohttp.ClientSession, url: str, want: bool = True, timeout: float = 60
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        status, body = await readyz(http, url)
        if (status == 200) == want:
            return body
        assert loop.time() < end, f"readyz stayed {status}: {body}"
        await asyncio.sleep(0.2)


async def state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    response = await http.get(f"{url}/v1/state", headers={"Authorization": f"Bearer {TOKEN}"})
    result: dict[str, Any] = await response.json()
    return result
