"""Issue 28 acceptance 2, the operator's side: generated agent answers against the real client.

A pod posing as an agent chooses its status code, headers (``Location`` among them) and body.
For every generated answer, the operator's ``AgentClient`` (the one the reconciler uses) must:
send no request anywhere but the pod's address and the path it asked for; raise nothing but an
``AgentError``; and say nothing, in what it returns or raises, that carries the bearer token or
the answer's text beyond a bounded one-line reason of our own schema.
"""

from __future__ import annotations

import asyncio
import json
import string
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from weightroll_operator.agent_client import MAX_REASON_CHARS, AgentClient
from weightroll_operator.errors import AgentError
from weightroll_operator.ports import AgentTarget

from engine_agent.protocol import SourceSpec, UpdateRequest

TOKEN = "tok-" + "Z9" * 12
MARK = "LEAKMARK"  # planted in every generated answer: it must never come back out


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: The body is in our schema (an error or a state): its bounded message may be repeated.
    schema: bool = False


@dataclass
class World:
    answer: Answer = field(default_factory=Answer)
    pod_paths: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)
    examples: int = 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def answers(draw: st.DrawFn, elsewhere_port: int) -> Answer:
    status = draw(
        st.sampled_from(
            [200, 201, 204, 301, 302, 303, 307, 308, 400, 401, 404, 409, 422, 500, 502, 503]
        )
    )
    planted = f"{MARK} Bearer {TOKEN}\r\n\x1b[31m"
    shape = draw(st.sampled_from(["agent-state", "error", "json", "raw", "deep", "huge-int"]))
    if shape == "agent-state":
        body: Any = {
            "version": draw(st.sampled_from(["v1", planted])),
            "engineState": draw(st.sampled_from(["clean", planted])),
            "ready": True,
            "paused": False,
            "message": planted * draw(st.integers(1, 50)),
        }
        raw = json.dumps(body).encode()
    elif shape == "error":
        error = {"code": "x", "message": planted * draw(st.integers(1, 50)), "field": planted}
        raw = json.dumps({"error": error, "activeId": planted}).encode()
    elif shape == "json":
        raw = json.dumps({"k": draw(_json), "m": planted}).encode()
    elif shape == "deep":
        depth = draw(st.integers(100, 5000))
        raw = ("[" * depth + json.dumps(planted) + "]" * depth).encode()
    elif shape == "huge-int":
        raw = (
            b'{"version": '
            + b"9" * draw(st.integers(4300, 20000))
            + b', "m": "'
            + planted.encode("unicode_escape")
            + b'"}'
        )
    else:
        raw = (planted + draw(st.text(string.printable, max_size=200))).encode()
    headers = {"X-Echo": MARK}
    if 300 <= status < 400:
        where = draw(st.sampled_from(["elsewhere", "self", "relative", "garbage"]))
        headers["Location"] = {
            "elsewhere": f"http://127.0.0.1:{elsewhere_port}/{MARK}",
            "self": f"/v1/state?{MARK}",
            "relative": f"../../{MARK}",
            "garbage": f"ht!tp://{MARK}\u2603",
        }[where]
    schema = shape in ("agent-state", "error")
    return Answer(status=status, headers=headers, body=raw, schema=schema)


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def _check_text(text: str, answer: Answer) -> None:
    assert TOKEN not in text, text[:300]
    assert answer.schema or MARK not in text, text[:300]
    assert "\n" not in text and "\r" not in text and "\x1b" not in text, repr(text[:300])


def test_generated_agent_answers_leak_nothing_and_follow_nowhere() -> None:
    world = World()
    loop = asyncio.new_event_loop()

    async def pod(req: web.Request) -> web.Response:
        world.pod_paths.append(req.path)
        a = world.answer
        return web.Response(status=a.status, headers=a.headers, body=a.body)

    async def other(req: web.Request) -> web.Response:
        world.elsewhere.append(req.path)
        return web.Response(text="reached")

    async def setup() -> tuple[list[web.AppRunner], int, int]:
        pod_app, other_app = web.Application(), web.Application()
        pod_app.router.add_route("*", "/{tail:.*}", pod)
        other_app.router.add_route("*", "/{tail:.*}", other)
        (r1, pod_port), (r2, other_port) = await _serve(pod_app), await _serve(other_app)
        return [r1, r2], pod_port, other_port

    runners, pod_port, other_port = loop.run_until_complete(setup())
    client = AgentClient(timeout=5.0)
    target = AgentTarget(pod="pod-0", base_url=f"http://127.0.0.1:{pod_port}", token=TOKEN)
    request = UpdateRequest(id="u-1", version="v2", source=SourceSpec(uri="/models/v2"))
    calls = {
        "state": (lambda: client.state(target), "/v1/state"),
        "get": (lambda: client.get_update(target, "u-1"), "/v1/updates/u-1"),
        "start": (lambda: client.start_update(target, request), "/v1/updates"),
        "abort": (lambda: client.abort_update(target, "u-1"), "/v1/updates/u-1/abort"),
        "swap": (lambda: client.swap_update(target, "u-1"), "/v1/updates/u-1/swap"),
    }

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(answer=answers(other_port), call=st.sampled_from(sorted(calls)))
    # Found by this generator: a version is repeated verbatim (status, labels), so a state
    # whose version carried the token reached the caller; versions now follow our grammar.
    @example(
        answer=Answer(
            body=json.dumps(
                {
                    "version": f"{MARK} Bearer {TOKEN}\r\n",
                    "engineState": "clean",
                    "ready": True,
                    "paused": False,
                    "message": MARK,
                }
            ).encode(),
            schema=True,
        ),
        call="state",
    )
    def one(answer: Answer, call: str) -> None:
        world.answer, world.pod_paths[:] = answer, []
        world.examples += 1
        make, path = calls[call]
        try:
            result = loop.run_until_complete(make())
        except AgentError as e:
            _check_text(str(e), answer)
            assert len(str(e)) <= MAX_REASON_CHARS + 120, str(e)
        else:
            if result is not None and hasattr(result, "model_dump"):
                for value in _strings(result.model_dump(mode="json")):
                    _check_text(value, answer)
        assert world.pod_paths == [path], world.pod_paths
        assert world.elsewhere == [], "a request left for an address the agent named"

    try:
        one()
        assert world.examples >= 250, world.examples
    finally:
        loop.run_until_complete(client.close())
        for r in runners:
            loop.run_until_complete(r.cleanup())
        loop.close()


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
