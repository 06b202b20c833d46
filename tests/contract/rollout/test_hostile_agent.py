"""Issue 28 items 3 and 4: what a pod posing as an agent answers never leaves with our token nor
comes back into status, Events or logs.

Anyone who can create a pod in a namespace can run something on the port named ``weightroll``
of a selected pod. Here that something is a real HTTP server on loopback that answers every
request with a redirect: to a "cloud metadata" server (SSRF: on main the operator followed it,
parsed the credentials as an agent answer and quoted them into ``status.pods[].reason``), or to
itself forever (on main the redirect error's ``repr`` carried the request headers, the bearer
token among them, into status and the log). The operator's real reconciler and agent client run
against kmock; the assertions read the stored WeightUpdate, the Events, the log and what the
metadata server received.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from aiohttp import web

from tests.contract.rollout.harness import NS, Harness
from tests.harness.kube_fleet import make_pod

pytestmark = pytest.mark.asyncio

TOKEN = "s3cret"  # the harness's token Secret
CREDENTIALS = "AKIAHOSTILEEXAMPLE/wJalrXUtnFEMIK7MDENGbPxRfiCY"


@dataclass
class Servers:
    agent_port: int
    metadata_requests: list[str] = field(default_factory=list)
    agent_requests: int = 0


async def _site(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    port: int = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, port


@pytest_asyncio.fixture(params=["to-metadata", "loop"])
async def hostile(request: pytest.FixtureRequest) -> AsyncIterator[Servers]:
    """A metadata server with credentials, and an "agent" that redirects every request."""
    runners = []
    servers = Servers(agent_port=0)

    async def metadata(req: web.Request) -> web.Response:
        servers.metadata_requests.append(f"{req.method} {req.path_qs}")
        # Shaped like an agent answer, so that parsing it would quote the credentials.
        body = {"version": CREDENTIALS, "engineState": CREDENTIALS, "message": CREDENTIALS}
        return web.json_response(body, headers={"X-Secret": CREDENTIALS})

    meta_app = web.Application()
    meta_app.router.add_route("*", "/{tail:.*}", metadata)
    runner, meta_port = await _site(meta_app)
    runners.append(runner)

    async def redirect(req: web.Request) -> web.Response:
        servers.agent_requests += 1
        if request.param == "loop":
            target = f"http://127.0.0.1:{servers.agent_port}{req.path_qs}?t={TOKEN}"
        else:
            target = f"http://127.0.0.1:{meta_port}/latest/meta-data/iam/security-credentials/"
        raise web.HTTPFound(target, reason=f"Found {req.headers.get('Authorization')}")

    agent_app = web.Application()
    agent_app.router.add_route("*", "/{tail:.*}", redirect)
    runner, servers.agent_port = await _site(agent_app)
    runners.append(runner)
    try:
        yield servers
    finally:
        for r in runners:
            await r.cleanup()


async def _events(h: Harness) -> list[str]:
    async with h.http.get(f"/api/v1/namespaces/{NS}/events") as resp:
        body = await resp.json()
    return [str(e) for e in body.get("items") or []]


async def _ticks(h: Harness, n: int, tick: Callable[[], Awaitable[object]]) -> None:
    for _ in range(n):
        try:
            await tick()
        except Exception:  # a pass may end in an error the handler would retry; judged below
            logging.getLogger(__name__).info("pass ended in an error")


async def test_a_redirecting_agent_gets_no_follow_and_nothing_it_says_is_repeated(
    h: Harness, hostile: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await h.add_pods(1)  # the token Secret and one honest pod
    await h.create_pod(make_pod("pod-hostile", "127.0.0.1", hostile.agent_port))
    await h.create_wu("wu", "v2")
    h.rec.observer.agent_backoff = 0.0
    await _ticks(h, 6, lambda: h.tick("wu"))

    assert hostile.agent_requests > 0, "the hostile pod was never asked (test did not run)"
    assert hostile.metadata_requests == [], "the operator followed an agent's redirect"
    status = await h.status("wu")
    stored = str(status)
    reason = next(p for p in status.get("pods") or [] if p.get("name") == "pod-hostile")
    assert "redirect" in str(reason), reason  # our own words, not the agent's
    seen = [stored, *(await _events(h)), caplog.text]
    for text in seen:
        assert TOKEN not in text, "the bearer token reached status, an Event or the log"
        assert CREDENTIALS not in text, "an agent's answer reached status, an Event or the log"
        assert "Authorization" not in text
