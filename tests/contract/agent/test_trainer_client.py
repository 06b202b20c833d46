"""Contract: the trainer client (``engine_agent.trainer.AgentSyncClient``) against the agent's
TLS, as the operator's client uses it (issue 28, item 6), and against redirects.

The agent is the real sidecar serving TLS with certificates made by openssl (the fixtures of
``test_tls.py``); the client verifies the chain to the CA and the name
``weightroll-agent.<namespace>.svc`` while connecting to the pod address.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from engine_agent.sidecar import Agent, TokenFile, create_app
from engine_agent.sidecar.listener import tls_context
from engine_agent.trainer import AgentSyncClient, PushRejected, ReplicaUnreachable
from tests.contract.agent.conftest import agent_config
from tests.contract.agent.test_tls import NS, certs  # noqa: F401 (the certificates fixture)
from tests.harness.fake_agent import free_port
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

SERVER_NAME = f"weightroll-agent.{NS}.svc"
#: Start the real sidecar serving TLS with a certificate pair; returns its https:// base URL.
Start = Callable[[tuple[Path, Path]], Awaitable[str]]


@pytest_asyncio.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Start]:
    fake = FakeVllm.tp(1)
    await fake.start()
    runners: list[web.AppRunner] = []
    (tmp_path / "token").write_text("operator-token\n")
    (tmp_path / "trainer-token").write_text("tok-1\n")

    async def start(cert: tuple[Path, Path]) -> str:
        config = dataclasses.replace(
            agent_config(fake, tmp_path / f"state-{len(runners)}"),
            trainer_token_file=tmp_path / "trainer-token",
        )
        agent = Agent(config)
        runner = web.AppRunner(create_app(agent, TokenFile(tmp_path / "token")))
        await runner.setup()
        port = free_port()
        tls = tls_context(str(cert[0]), str(cert[1]))
        assert tls is not None
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.context).start()
        runners.append(runner)
        await asyncio.wait_for(agent._recovered.wait(), 10)
        return f"https://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
    await fake.stop()


async def test_the_trainer_client_verifies_the_agent_certificate_and_its_name(
    serve: Start,
    certs: dict[str, tuple[Path, Path]],  # noqa: F811
) -> None:
    ca = certs["ca"][0]
    good = await serve(certs["good"])
    client = AgentSyncClient(good, token="tok-1", ca_file=ca, server_name=SERVER_NAME, timeout=10)
    info = await asyncio.to_thread(client.weight_info)
    assert info["world_size"] == 1, info
    for impostor in ("other-ns", "rogue"):  # another namespace's name; another CA
        url = await serve(certs[impostor])
        other = AgentSyncClient(url, token="tok-1", ca_file=ca, server_name=SERVER_NAME, timeout=10)
        with pytest.raises(ReplicaUnreachable, match=r"(?i)certificate"):
            await asyncio.to_thread(other.weight_info)
    # Without the CA the system trust store decides: the chart's CA is not in it.
    with pytest.raises(ReplicaUnreachable, match=r"(?i)certificate"):
        await asyncio.to_thread(AgentSyncClient(good, token="tok-1", timeout=10).weight_info)
    with pytest.raises(ValueError, match="https"):
        AgentSyncClient("http://127.0.0.1:8470", token="tok-1", ca_file=ca)


async def test_the_trainer_client_never_follows_a_redirect() -> None:
    """A redirect would carry the bearer token to whatever host it names."""
    seen: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"weight_version": "v9", "world_size": 1})

    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    try:
        target = web.Application()
        target.router.add_get("/weight_info", elsewhere)
        other = await start(target)

        async def redirect(_: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(location=f"{other}/weight_info")

        agent = web.Application()
        agent.router.add_get("/weight_info", redirect)
        url = await start(agent)
        client = AgentSyncClient(url, token="secret-token", timeout=10)
        with pytest.raises(PushRejected) as refused:
            await asyncio.to_thread(client.weight_info)
        assert refused.value.status == 307
        assert seen == []
    finally:
        for runner in runners:
            await runner.cleanup()
