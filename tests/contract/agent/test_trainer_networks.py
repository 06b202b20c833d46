"""Contract: the real ``weightroll-agent`` process refuses a trainer rendezvous outside the
trainer networks before vLLM is asked anything (issue 28, item 2).

A trainer's ``init_info`` names the peer every vLLM worker connects to, and vLLM's NCCL
rendezvous unpickles what that peer publishes: an agent-token holder who could name any host
could run code in the workers. Each test starts the agent as its own process
(``python -m engine_agent.sidecar.main``) in front of the fake vLLM, whose ranks run the real
worker-side check (``engine_agent.transfer.rendezvous``), and asserts what reaches the fake:
nothing, unless the address is an IP address inside ``WEIGHTROLL_AGENT_TRAINER_NETWORKS`` and
every rank accepted it too. The real worker backends' own check (and the NCCL unique id read
without unpickling) are in ``tests/unit/engine_agent/test_transfer.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession

from engine_agent.protocol import ErrorBody
from tests.contract.agent.conftest import TOKEN
from tests.harness.agent_process import AgentProcess as RunningAgent
from tests.harness.agent_process import AgentProcesses
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

#: The operator's token (``--token-file``): ``/v1`` only.
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: The trainers' token (``--trainer-token-file``, a second Secret): the trainer routes only.
TRAINER_TOKEN = "trainer-s3cret"
TRAINER_AUTH = {"Authorization": f"Bearer {TRAINER_TOKEN}"}
SETTING = "WEIGHTROLL_AGENT_TRAINER_NETWORKS"


Spawn = Callable[..., Any]


@pytest.fixture
def fake_ranks() -> int:
    return 2  # every rank runs the worker-side check


@pytest_asyncio.fixture
async def spawn(fake: FakeVllm, tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start the real agent configured by environment variables (``ready``: wait for /readyz)."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    trainer_token = tmp_path / "trainer-token"
    trainer_token.write_text(TRAINER_TOKEN + "\n")
    agents = AgentProcesses(fake.url, token, tmp_path, ready_headers=AUTH)

    async def start(*, ready: bool = True, **settings: str) -> RunningAgent:
        wanted = {"trainer_token_file": str(trainer_token), "watch_interval": "0.2", **settings}
        return await agents.start(ready=ready, **wanted)

    yield start
    await agents.stop()


async def _post(
    agent: RunningAgent, route: str, body: Any, headers: dict[str, str] = TRAINER_AUTH
) -> tuple[int, dict[str, Any]]:
    async with ClientSession() as http:
        response = await http.post(f"{agent.url}{route}", json=body, headers=headers)
        return response.status, await response.json()


def _init(**fields: Any) -> dict[str, Any]:
    info = {"master_port": 29500, "rank_offset": 1, "world_size": 3, **fields}
    return {"init_info": info}


def _nothing_reached_vllm(fake: FakeVllm) -> None:
    assert fake.transfer_inits == []
    assert fake.calls("weightroll_transfer_check_init") == 0
    assert fake.calls("weightroll_transfer_arm") == 0
    assert not fake.paused


#: (master_address, code): every spelling that is not an IP address inside 127.0.0.1/32.
OUTSIDE = [
    ("10.1.2.3", "rendezvous_not_allowed"),  # another host
    ("127.0.0.2", "rendezvous_not_allowed"),  # loopback, but not the listed address
    ("localhost", "rendezvous_not_allowed"),  # a host name resolves wherever DNS says
    ("evil.example.com", "rendezvous_not_allowed"),
    ("127.1", "rendezvous_not_allowed"),  # inet_aton shorthand: not an address literal
    ("0x7f.0.0.1", "rendezvous_not_allowed"),
    ("0177.0.0.1", "rendezvous_not_allowed"),
    ("127.0.0.1 ", "rendezvous_not_allowed"),  # no trimming: the worker would get it as is
    ("::ffff:10.1.2.3", "rendezvous_not_allowed"),  # IPv4-mapped: judged as 10.1.2.3
    ("0.0.0.0", "rendezvous_not_allowed"),
    ("::1", "rendezvous_not_allowed"),  # IPv6 loopback is not in an IPv4 network
    (7, "invalid_request"),
]


async def test_a_rendezvous_outside_the_trainer_networks_never_reaches_vllm(
    spawn: Spawn, fake: FakeVllm
) -> None:
    agent = await spawn(trainer_networks="127.0.0.1/32")
    for address, code in OUTSIDE:
        status, body = await _post(
            agent, "/init_weight_transfer_engine", _init(master_address=address)
        )
        error = ErrorBody.model_validate(body)
        assert (status, error.code) == (403 if code != "invalid_request" else 422, code), (
            address,
            body,
        )
        assert error.field == "init_info.master_address", body
        if code == "rendezvous_not_allowed" and address in ("10.1.2.3", "127.0.0.2"):
            assert SETTING in error.message and "127.0.0.1/32" in error.message, body
    # Other ways to name a peer the agent cannot check: NCCL's pre-shared unique id (it embeds
    # a bootstrap address) and fields no weightroll backend knows.
    for info, code, field in (
        ({"nccl_unique_id_b64": "A" * 172}, "rendezvous_not_allowed", "nccl_unique_id_b64"),
        (
            {"master_address": "127.0.0.1", "store_host": "10.1.2.3"},
            "invalid_request",
            "store_host",
        ),
        ({"master_address": "127.0.0.1", "master_port": 0}, "invalid_request", "master_port"),
    ):
        status, body = await _post(agent, "/init_weight_transfer_engine", _init(**info))
        assert (status, body["code"], body["field"]) == (
            403 if code != "invalid_request" else 422,
            code,
            f"init_info.{field}",
        ), (info, body)
    _nothing_reached_vllm(fake)
    assert "Refused a trainer's rendezvous" in agent.log.read_text()


async def test_without_trainer_networks_every_push_is_refused(spawn: Spawn, fake: FakeVllm) -> None:
    agent = await spawn()  # the default: no trainer networks
    status, body = await _post(
        agent, "/init_weight_transfer_engine", _init(master_address="127.0.0.1")
    )
    assert (status, body["code"]) == (403, "trainer_push_disabled"), body
    assert SETTING in body["message"] and "workloadExample.trainerNetworks" in body["message"]
    status, body = await _post(agent, "/start_weight_update", {})
    assert (status, body["code"]) == (403, "trainer_push_disabled"), body
    _nothing_reached_vllm(fake)
    async with ClientSession() as http:  # the replica was never held: it keeps serving
        assert (await http.get(f"{agent.url}/readyz", headers=AUTH)).status == 200


async def test_an_allowed_rendezvous_reaches_vllm_once_every_rank_accepted(
    spawn: Spawn, fake: FakeVllm
) -> None:
    agent = await spawn(trainer_networks="10.0.0.0/8, 127.0.0.1")
    request = _init(master_address="127.0.0.1", timeout_s=30.0)
    status, body = await _post(agent, "/init_weight_transfer_engine", request)
    assert status == 200, body
    assert fake.transfer_inits == [request]
    assert fake.calls("weightroll_transfer_check_init") == 2  # each rank checked it first
    # A rank whose own trainer networks (WEIGHTROLL_TRAINER_NETWORKS in the vLLM container)
    # are narrower refuses, and vLLM's init is not called.
    fake.ranks[1].trainer_networks = "10.0.0.0/8"
    status, body = await _post(agent, "/init_weight_transfer_engine", request)
    assert (status, body["code"]) == (403, "rendezvous_not_allowed"), body
    assert "rank dp0:pp0:tp1:ep0" in body["message"], body
    assert "WEIGHTROLL_TRAINER_NETWORKS" in body["message"], body
    assert fake.transfer_inits == [request]


async def test_a_trainer_networks_setting_that_is_not_a_network_stops_the_agent(
    spawn: Spawn,
) -> None:
    for bad in ("10.0.0.1/8", "trainers.example.com", "127.0.0.1/33"):
        agent = await spawn(ready=False, trainer_networks=bad)
        assert await asyncio.wait_for(agent.process.wait(), 60) == 2
        log = agent.log.read_text()
        assert SETTING in log and repr(bad) in log, log


# ------------------------------------------------------- one credential per role (item 6)


async def test_the_operator_token_does_not_open_the_trainer_routes_nor_the_trainer_token_v1(
    spawn: Spawn, fake: FakeVllm
) -> None:
    agent = await spawn(trainer_networks="127.0.0.1/32")
    request = _init(master_address="127.0.0.1")
    status, body = await _post(agent, "/init_weight_transfer_engine", request, headers=AUTH)
    assert (status, body["code"]) == (401, "unauthorized"), body
    assert "operator's token does not open the trainer routes" in body["message"]
    assert TOKEN not in json.dumps(body)
    async with ClientSession() as http:
        response = await http.get(f"{agent.url}/v1/state", headers=TRAINER_AUTH)
        assert response.status == 401, await response.text()
        response = await http.get(f"{agent.url}/weight_info", headers=AUTH)
        assert response.status == 401, await response.text()
    _nothing_reached_vllm(fake)
    status, _ = await _post(agent, "/init_weight_transfer_engine", request)  # the trainer's
    assert status == 200


async def test_without_a_trainer_token_the_trainer_routes_are_closed(
    spawn: Spawn, fake: FakeVllm
) -> None:
    agent = await spawn(trainer_networks="127.0.0.1/32", trainer_token_file="")
    for headers in (AUTH, TRAINER_AUTH):
        status, body = await _post(
            agent, "/init_weight_transfer_engine", _init(master_address="127.0.0.1"), headers
        )
        assert (status, body["code"]) == (401, "unauthorized"), body
        assert "WEIGHTROLL_AGENT_TRAINER_TOKEN_FILE" in body["message"], body
    _nothing_reached_vllm(fake)


async def test_one_token_for_both_roles_stops_the_agent(spawn: Spawn, tmp_path: Path) -> None:
    shared, empty = tmp_path / "shared-token", tmp_path / "empty-token"
    shared.write_text(f"another\n{TOKEN}\n")
    empty.write_text("\n")
    for path, why in (
        (shared, "shares a token with --token-file"),
        (empty, "is empty"),
        (tmp_path / "missing", "cannot read token file"),
    ):
        agent = await spawn(ready=False, trainer_token_file=str(path))
        assert await asyncio.wait_for(agent.process.wait(), 60) == 2
        log = agent.log.read_text()
        assert why in log and TOKEN not in log, log
