"""The real agent as its own process (``python -m engine_agent.sidecar.main``), for tests that
must see what the shipped entry point does: its settings (``WEIGHTROLL_AGENT_*`` variables), its
listener and timeouts, its exit codes.

:class:`AgentProcesses` starts agents configured by environment variables (the way the chart
configures them), waits until each answers ``/readyz`` 200 when asked to, and stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, TCPConnector

from tests.harness.ports import free_port

__all__ = ["AgentHttp", "AgentProcess", "AgentProcesses", "agent_env", "free_port"]

ROOT = Path(__file__).resolve().parents[2]


def agent_env(**settings: str) -> dict[str, str]:
    """This environment without any ``WEIGHTROLL_AGENT_*``, plus ``settings`` as those
    variables (``token_file=...`` → ``WEIGHTROLL_AGENT_TOKEN_FILE``; empty values left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTROLL_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update({f"WEIGHTROLL_AGENT_{k.upper()}": v for k, v in settings.items() if v})
    return env


@dataclass
class AgentProcess:
    process: asyncio.subprocess.Process
    port: int
    #: The process's stdout and stderr.
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class AgentProcesses:
    """Agents in front of the vLLM at ``vllm_url``, each with its own port, log and state dir."""

    vllm_url: str
    token_file: Path
    workdir: Path
    #: Headers of the readiness poll (``/readyz`` answers 200 to anyone; the token adds reasons).
    ready_headers: dict[str, str] = field(default_factory=dict)
    started: list[AgentProcess] = field(default_factory=list)

    async def start(self, *, ready: bool = True, **settings: str) -> AgentProcess:
        """Start one agent; ``settings`` override the defaults (an empty value unsets one)."""
        port = free_port()
        log = self.workdir / f"agent-{port}.log"
        wanted = {
            "host": "127.0.0.1",
            "port": str(port),
            "vllm_url": self.vllm_url,
            "token_file": str(self.token_file),
            "state_dir": str(self.workdir / f"state-{port}"),
            "watch_interval": "0.1",
            **settings,
        }
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine_agent.sidecar.main",
                env=agent_env(**wanted),
                stdout=out,
                stderr=out,
            )
        agent = AgentProcess(process, port, log)
        self.started.append(agent)
        if ready:
            await self.until_ready(agent)
        return agent

    async def until_ready(self, agent: AgentProcess, timeout: float = 60) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        async with ClientSession(connector=TCPConnector(force_close=True)) as http:
            while True:
                assert agent.process.returncode is None, agent.log.read_text()
                with contextlib.suppress(ClientError):
                    response = await http.get(f"{agent.url}/readyz", headers=self.ready_headers)
                    if response.status == 200:
                        return
                assert loop.time() < end, f"the agent never became ready: {agent.log.read_text()}"
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for agent in self.started:
            if agent.process.returncode is None:
                agent.process.terminate()
                try:
                    await asyncio.wait_for(agent.process.wait(), 20)
                except TimeoutError:
                    agent.process.kill()
                    await agent.process.wait()


@dataclass
class AgentHttp:
    """An HTTP client of one agent, sending ``headers`` (the token) with every call."""

    url: str
    http: ClientSession
    headers: dict[str, str]

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        response = await self.http.request(method, self.url + path, json=body, headers=self.headers)
        return response.status, await response.json()

    async def run_update(self, body: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
        """POST the update (must be accepted, 202) and poll it until it ends."""
        status, answer = await self.request("POST", "/v1/updates", body)
        assert status == 202, answer
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            _, answer = await self.request("GET", f"/v1/updates/{body['id']}")
            if answer["phase"] in ("Committed", "Failed", "Aborted"):
                return answer  # type: ignore[no-any-return]
            assert loop.time() < end, f"update stuck: {answer}"
            await asyncio.sleep(0.05)

    async def readyz(self) -> tuple[int, Any]:
        # reasons are named only to a token holder (they can carry paths)
        response = await self.http.get(self.url + "/readyz", headers=self.headers)
        return response.status, await response.json()
