"""Contract: the real ``weightroll-agent`` process against hostile clients (issue 28, item 8).

Each test starts the agent as its own process (``python -m engine_agent.sidecar.main``) in front
of the fake vLLM, configured through its environment variables, and attacks its HTTP surface:
half-sent requests (slowloris), malformed bodies, wildcard listen addresses in every spelling,
sources outside the model volume, and the anonymous ``/readyz``. The only timed assertions are
generous upper bounds (a dropped connection must be dropped within 30 s of a 1 s timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientError, ClientSession, TCPConnector

from engine_agent.protocol import ErrorBody
from engine_agent.sidecar.listener import listen_host
from tests.contract.agent.conftest import TOKEN, make_checkpoint, update_body
from tests.harness.agent_process import AgentProcesses, agent_env, free_port
from tests.harness.fake_vllm import FakeVllm

AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Generous bound for anything that a 1 s timeout must end (a loaded CI machine included).
BOUND = 30.0


Spawn = Callable[..., Any]


@pytest_asyncio.fixture
async def spawn(fake: FakeVllm, token_file: Path, tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start the real agent, configured by environment variables; wait until it is ready."""
    agents = AgentProcesses(fake.url, token_file, tmp_path)
    yield agents.start
    await agents.stop()


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Whatever the server sent before it closed the connection (b"" if nothing)."""
    try:
        return await asyncio.wait_for(reader.read(), BOUND)
    except (ConnectionResetError, BrokenPipeError):
        return b""


# ---------------------------------------------------------------------------------- slowloris


@pytest.mark.asyncio
async def test_half_sent_requests_are_dropped_and_others_still_served(spawn: Spawn) -> None:
    agent = await spawn(header_timeout="1", body_timeout="1")
    conns: list[tuple[str, asyncio.StreamReader, asyncio.StreamWriter]] = []
    for i in range(10):  # a request head that never ends
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nX-Slow-" + str(i).encode())
        await writer.drain()
        conns.append(("head", reader, writer))
    for _ in range(10):  # an authorised body that never ends
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        writer.write(
            b"POST /v1/updates HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"id": "u-'
        )
        await writer.drain()
        conns.append(("body", reader, writer))
    try:
        # served while they are held
        async with ClientSession(connector=TCPConnector(force_close=True)) as http:
            response = await http.get(f"{agent.url}/v1/state", headers=AUTH)
            assert response.status == 200
        answers = await asyncio.gather(*(_closed_by_server(reader) for _, reader, _ in conns))
        for (kind, _, _), answer in zip(conns, answers, strict=True):
            if kind == "head":
                assert answer == b"", answer  # closed without an answer
            else:  # closed after a 408 in the error schema
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408"), answer
                error = ErrorBody.model_validate_json(body)
                assert error.code == "request_timeout"
        async with ClientSession(connector=TCPConnector(force_close=True)) as http:
            response = await http.get(f"{agent.url}/v1/state", headers=AUTH)
            assert response.status == 200
        assert agent.process.returncode is None
    finally:
        for _, _, writer in conns:
            writer.close()


@pytest.mark.asyncio
async def test_connections_beyond_the_bound_are_closed_on_accept(spawn: Spawn) -> None:
    agent = await spawn(max_connections="4", header_timeout="120")
    idle = [await asyncio.open_connection("127.0.0.1", agent.port) for _ in range(4)]
    try:
        for reader, writer in idle:  # served, so certainly counted; kept open (keep-alive)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), BOUND)
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            await writer.drain()
        assert await _closed_by_server(reader) == b""  # over the bound: no answer
        writer.close()
    finally:
        for _, w in idle:
            w.close()
    # the slots free up as the held connections go
    loop = asyncio.get_running_loop()
    end = loop.time() + BOUND
    async with ClientSession(connector=TCPConnector(force_close=True)) as http:
        while True:
            with contextlib.suppress(ClientError):
                if (await http.get(f"{agent.url}/healthz")).status == 200:
                    break
            assert loop.time() < end, "the agent never served again"
            await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------- malformed bodies

_MARK = "ZZ-echo-marker"
MALFORMED: list[tuple[str, bytes, str]] = [
    ("deep-array", b"[" * 200_000, "nested too deeply"),
    ("deep-object", b'{"' + _MARK.encode() + b'": ' + b'{"a": ' * 100_000, "nested too deeply"),
    ("huge-int", b'{"id": "' + _MARK.encode() + b'", "n": 1' + b"0" * 5000 + b"}", "too long"),
    ("nan", b'{"id": "' + _MARK.encode() + b'", "n": NaN}', "not a JSON number"),
    ("infinity", b'{"n": -Infinity, "m": "' + _MARK.encode() + b'"}', "not a JSON number"),
    ("float-overflow", b'{"n": 1e999, "m": "' + _MARK.encode() + b'"}', "out of range"),
    ("not-utf8", b'{"m": "' + _MARK.encode() + b'\xff\xfe"}', "not valid JSON"),
    ("truncated", b'{"m": "' + _MARK.encode() + b'", ', "not valid JSON"),
    ("not-an-object", b'["' + _MARK.encode() + b'"]', "JSON object"),
]
ROUTES = ["/v1/updates", "/v1/updates/u-1/abort", "/init_weight_transfer_engine"]


@pytest.mark.asyncio
async def test_malformed_bodies_get_the_error_schema_never_500(spawn: Spawn) -> None:
    agent = await spawn()
    async with ClientSession(connector=TCPConnector(force_close=True)) as http:
        for route in ROUTES:
            for name, payload, text in MALFORMED:
                response = await http.post(
                    agent.url + route,
                    data=payload,
                    headers={**AUTH, "Content-Type": "application/json"},
                )
                raw = await response.read()
                where = f"{name} on {route}: {response.status} {raw[:300]!r}"
                assert response.status == 400, where
                error = ErrorBody.model_validate_json(raw)
                assert error.code == "malformed_json", where
                assert text in error.message, where
                assert _MARK not in raw.decode("utf-8", "replace"), where
        response = await http.post(
            agent.url + "/v1/updates",
            data=b'{"pad": "' + b"x" * (2 * 1024 * 1024) + b'"}',
            headers={**AUTH, "Content-Type": "application/json"},
        )
        assert response.status == 413
        assert ErrorBody.model_validate_json(await response.read()).code == "body_too_large"
        # still serving, still ready
        assert (await http.get(agent.url + "/readyz")).status == 200
    assert agent.process.returncode is None


# ------------------------------------------------------------------------- listen addresses

WILDCARDS = [
    "0",
    "0x0",
    "00",
    "0.0",
    "0.0.0",
    "0.0.0.0",
    " 0 ",
    "::",
    "::0",
    "[::0]",
    "0:0:0:0:0:0:0:0",
    "0000:0000:0000:0000:0000:0000:0000:0000",
    "::ffff:0.0.0.0",
    "*",
    "",
]


@pytest.mark.asyncio
@pytest.mark.parametrize("host", WILDCARDS)
async def test_agent_process_refuses_every_spelling_of_the_wildcard(
    host: str, fake: FakeVllm, token_file: Path, tmp_path: Path
) -> None:
    env = agent_env(host=host, port=str(free_port()), vllm_url=fake.url, token_file=str(token_file))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine_agent.sidecar.main",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(process.communicate(), BOUND)
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"the agent started listening on --host {host!r}")
    assert process.returncode == 2
    assert b"never on a wildcard address" in err, err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "::1", "[::1]", "localhost", "10.1.2.3"])
def test_specific_addresses_are_accepted(host: str) -> None:
    assert listen_host(host) == host.strip("[]")


# ---------------------------------------------------------------------- sources and /readyz


@pytest.fixture
def volume(tmp_path: Path) -> dict[str, Path]:
    """A model volume with one checkpoint, a secret outside it, and symlinks that escape."""
    models = tmp_path / "models"
    good = make_checkpoint(models, "v1", 1, version="v1")
    outside = make_checkpoint(tmp_path / "elsewhere", "v9", 9, version="v9")
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": "hunter2"}')
    (models / "link-out").symlink_to(outside, target_is_directory=True)
    (models / "manifest-link.json").symlink_to(secret)
    mixed = models / "mixed"
    mixed.mkdir()
    (mixed / "model-00001-of-00001.safetensors").symlink_to(
        outside / "model-00001-of-00002.safetensors"
    )
    return {"models": models, "good": good, "outside": outside, "secret": secret, "mixed": mixed}


def _refusals(v: dict[str, Path]) -> list[tuple[dict[str, str], str]]:
    models, good = v["models"], v["good"]
    return [
        ({"uri": f"file://{models}/../elsewhere/v9"}, "source.uri"),
        ({"uri": f"{models}/v1/../../elsewhere/v9"}, "source.uri"),
        ({"uri": f"file://{models}/link-out"}, "source.uri"),
        ({"uri": f"{models}/mixed"}, "source.uri"),
        ({"uri": str(v["outside"])}, "source.uri"),
        ({"uri": f"{models}/nowhere/../../secret.json"}, "source.uri"),
        ({"uri": f"file://{good}", "manifest": str(v["secret"])}, "source.manifest"),
        ({"uri": f"file://{good}", "manifest": f"{models}/manifest-link.json"}, "source.manifest"),
        ({"uri": str(good), "manifest": f"file://{models}/../secret.json"}, "source.manifest"),
    ]


@pytest.mark.asyncio
async def test_sources_outside_the_model_dir_are_refused_before_any_read(
    spawn: Spawn, fake: FakeVllm, volume: dict[str, Path]
) -> None:
    agent = await spawn(model_dir=str(volume["models"]))
    async with ClientSession(connector=TCPConnector(force_close=True)) as http:
        for i, (source, field) in enumerate(_refusals(volume)):
            body = update_body(f"bad-{i}", "v9", Path("/unused"))
            body["source"] = source
            response = await http.post(f"{agent.url}/v1/updates", json=body, headers=AUTH)
            raw = await response.read()
            assert response.status == 422, (source, raw)
            error = ErrorBody.model_validate_json(raw)
            assert (error.code, error.field) == ("invalid_request", field), (source, error)
            assert "outside the model directory" in error.message
            assert "hunter2" not in raw.decode()
            missing = await http.get(f"{agent.url}/v1/updates/bad-{i}", headers=AUTH)
            assert missing.status == 404  # never accepted
        assert fake.calls("weightroll_begin") == 0 and not fake.paused  # nothing was read
        good = update_body("good", "v1", volume["good"])
        good["source"]["manifest"] = f"file://{volume['good']}/manifest.json"
        response = await http.post(f"{agent.url}/v1/updates", json=good, headers=AUTH)
        assert response.status == 202, await response.text()


@pytest.mark.asyncio
async def test_source_root_cannot_be_escaped(
    spawn: Spawn, fake: FakeVllm, volume: dict[str, Path]
) -> None:
    root = volume["models"]  # the pod's "/" lies here: file:///v1 is <root>/v1
    agent = await spawn(source_root=str(root))
    async with ClientSession(connector=TCPConnector(force_close=True)) as http:
        for i, (source, field) in enumerate(
            [
                ({"uri": "file:///../elsewhere/v9"}, "source.uri"),
                ({"uri": "/link-out"}, "source.uri"),
                ({"uri": "/v1", "manifest": "/manifest-link.json"}, "source.manifest"),
            ]
        ):
            body = update_body(f"esc-{i}", "v9", Path("/unused"))
            body["source"] = source
            response = await http.post(f"{agent.url}/v1/updates", json=body, headers=AUTH)
            error = ErrorBody.model_validate_json(await response.read())
            assert response.status == 422, (source, error)
            assert (error.code, error.field) == ("invalid_request", field), (source, error)
        assert fake.calls("weightroll_begin") == 0
        response = await http.post(
            f"{agent.url}/v1/updates",
            json=update_body("inside", "v1", Path("/v1")),
            headers=AUTH,
        )
        assert response.status == 202, await response.text()


@pytest.mark.asyncio
async def test_anonymous_readyz_says_ready_or_not_and_nothing_else(
    spawn: Spawn, volume: dict[str, Path]
) -> None:
    agent = await spawn(model_dir=str(volume["models"]))
    probe = f"{volume['models']}/probe-a8f3/manifest.json"  # inside the volume, unreadable
    body = update_body("u-oracle", "v1", volume["good"])
    body["source"]["manifest"] = probe
    async with ClientSession(connector=TCPConnector(force_close=True)) as http:
        assert (await http.post(f"{agent.url}/v1/updates", json=body, headers=AUTH)).status == 202
        loop = asyncio.get_running_loop()
        end = loop.time() + BOUND
        while True:
            status = await (await http.get(f"{agent.url}/v1/updates/u-oracle", headers=AUTH)).json()
            if status["phase"] in ("Committed", "Failed", "Aborted"):
                break
            assert loop.time() < end, status
            await asyncio.sleep(0.05)
        assert status["phase"] == "Failed"
        anonymous = await http.get(f"{agent.url}/readyz")
        assert anonymous.status == 503
        assert json.loads(await anonymous.read()) == {"ready": False}
        for wrong in ({"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            other = await http.get(f"{agent.url}/readyz", headers=wrong)
            assert json.loads(await other.read()) == {"ready": False}
        authorised = await (await http.get(f"{agent.url}/readyz", headers=AUTH)).json()
        assert authorised["ready"] is False
        assert any("probe-a8f3" in reason for reason in authorised["reasons"]), authorised


# ------------------------------------------------------------------------- trainer rotation


@pytest.mark.asyncio
async def test_trainer_client_sends_the_first_token_line_during_a_rotation(
    spawn: Spawn, token_file: Path, tmp_path: Path
) -> None:
    """docs/architecture.md, "Threat model": mid-rotation the Secret holds two lines."""
    pytest.importorskip("vllm", reason="engine_agent.trainer imports vLLM's trainer engines")
    from engine_agent.trainer import AgentSyncClient, PushRejected

    trainer_tokens = tmp_path / "agent-trainer-tokens"
    trainer_tokens.write_text("new-token\n")  # the agent already accepts only the new token
    agent = await spawn(trainer_token_file=str(trainer_tokens))
    mounted = tmp_path / "trainer-token"
    mounted.write_text("\n  new-token  \nold-token\n")
    client = AgentSyncClient(agent.url, token_file=mounted, timeout=BOUND)
    info = await asyncio.to_thread(client.weight_info)
    assert "weight_version" in info
    mounted.write_text("old-token\nnew-token\n")  # the first line is sent, never the file
    with pytest.raises(PushRejected) as refused:
        await asyncio.to_thread(client.weight_info)
    assert refused.value.status == 401
