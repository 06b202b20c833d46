"""Issue 14 C: the operator's AgentClient talks to the real sidecar app over verified TLS.

The sidecar app (``create_app`` with the real :class:`Agent` over a fake vLLM) is served with the
agent's own TLS code (``sidecar.listener.tls_context``); certificates are made here with openssl:
a CA, a leaf for ``weightroll-agent.<ns>.svc``, and impostors (another CA; the right CA but
another namespace's name). The client succeeds only against the right certificate and never falls
back to plain HTTP. Multi-line token files (rotation) are accepted line by line.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from weightroll_operator.agent_client import AgentClient
from weightroll_operator.errors import AgentUnauthorized, AgentUnavailable
from weightroll_operator.ports import AgentTarget

from engine_agent.protocol import AgentState
from engine_agent.sidecar import Agent, TokenFile, create_app
from engine_agent.sidecar.listener import listen_host, tls_context
from tests.contract.agent.conftest import agent_config
from tests.harness.fake_agent import free_port
from tests.harness.fake_vllm import FakeVllm

NS = "ml"
#: Start a sidecar (certificate pair or plain HTTP, token file text); returns its base URL.
Start = Callable[..., Awaitable[str]]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(out: Path, name: str) -> tuple[Path, Path]:
    key, crt = out / f"{name}.key", out / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
             str(crt), "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return crt, key


def _leaf(out: Path, name: str, dns: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, crt, ext = (out / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", f"/CN={dns}")  # fmt: skip
    ext.write_text(f"subjectAltName=DNS:{dns}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return crt, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    out = tmp_path_factory.mktemp("certs")
    ca, rogue = _ca(out, "ca"), _ca(out, "rogue-ca")
    return {
        "ca": ca,
        "good": _leaf(out, "good", f"weightroll-agent.{NS}.svc", ca),
        "other-ns": _leaf(out, "otherns", "weightroll-agent.other.svc", ca),
        "rogue": _leaf(out, "rogue", f"weightroll-agent.{NS}.svc", rogue),
    }


@pytest_asyncio.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Start]:
    fake = FakeVllm.tp(1)
    await fake.start()
    runners: list[web.AppRunner] = []
    agents: list[Agent] = []

    async def start(cert: tuple[Path, Path] | None, tokens: str = "tok-1\n") -> str:
        token_file = tmp_path / f"token-{len(runners)}"
        token_file.write_text(tokens)
        agent = Agent(agent_config(fake, tmp_path / f"state-{len(runners)}"))
        agents.append(agent)
        runner = web.AppRunner(create_app(agent, TokenFile(token_file)))
        await runner.setup()
        tls = None if cert is None else tls_context(str(cert[0]), str(cert[1]))
        port = free_port()
        host = listen_host("127.0.0.1")
        site = web.TCPSite(runner, host, port, ssl_context=None if tls is None else tls.context)
        await site.start()
        runners.append(runner)
        await asyncio.wait_for(agent._recovered.wait(), 10)
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
    await fake.stop()


def _target(url: str, token: str = "tok-1") -> AgentTarget:
    return AgentTarget(pod="p", base_url=url, token=token, namespace=NS)


@pytest.mark.asyncio
async def test_operator_verifies_the_agent_certificate(
    serve: Start, certs: dict[str, tuple[Path, Path]]
) -> None:
    start = serve
    client = AgentClient(ca_file=str(certs["ca"][0]), timeout=5)
    try:
        good = await start(certs["good"])
        state = await client.state(_target(good))
        assert isinstance(state, AgentState)  # a verified, authorised, parsed answer
        for impostor in ("other-ns", "rogue"):
            url = await start(certs[impostor])
            with pytest.raises(AgentUnavailable, match=r"(?i)certificate"):
                await client.state(_target(url))
        plain = await start(None)
        with pytest.raises(AgentUnavailable):  # no fallback to plain HTTP
            await client.state(_target(plain))
        plain_client = AgentClient(timeout=5)  # without a CA: plain HTTP (chart default)
        try:
            await plain_client.state(_target(plain))
        finally:
            await plain_client.close()
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_every_line_of_the_token_file_is_accepted(
    serve: Start, certs: dict[str, tuple[Path, Path]]
) -> None:
    """A rotation step: old and new token both work; anything else is 401."""
    start = serve
    client = AgentClient(ca_file=str(certs["ca"][0]), timeout=5)
    try:
        url = await start(certs["good"], "tok-new\ntok-old\n")
        await client.state(_target(url, "tok-new"))
        await client.state(_target(url, "tok-old"))
        with pytest.raises(AgentUnauthorized):
            await client.state(_target(url, "tok-newtok-old"))  # the file, not a line of it
        with pytest.raises(AgentUnauthorized):
            await client.state(_target(url, "tok"))
    finally:
        await client.close()


@pytest.mark.parametrize("host", [None, "", "0.0.0.0", "::", "[::]"])
def test_agent_refuses_wildcard_or_missing_listen_address(host: str | None) -> None:
    with pytest.raises(ValueError, match="pod IP"):
        listen_host(host)


def test_agent_listens_on_pod_ip_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_agent.sidecar.main import parse_args

    monkeypatch.setenv("POD_IP", "10.1.2.3")
    monkeypatch.delenv("WEIGHTROLL_AGENT_HOST", raising=False)
    assert listen_host(parse_args([]).host) == "10.1.2.3"
