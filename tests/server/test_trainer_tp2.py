"""Server tier, trainer path, TP=2: a push over ``weightroll_gloo`` reaches both ranks (each
slices the full tensors itself), both must agree before the agent answers 200, and one rank
refusing fences the whole replica. A cold TP=2 engine on the pushed weights is the oracle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.server.conftest import TOKEN, build_models
from tests.server.trainer_scenario import (
    call,
    outputs,
    run_trainer,
    start_replica,
    state,
    stop_replica,
    wait_ready,
)
from tests.server.vllm_server import VllmServer

pytestmark = [pytest.mark.server, pytest.mark.tp2, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def tp2(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-tp2")
    models = build_models(root / "models")
    token = root / "token"
    token.write_text(TOKEN)
    failpoints = root / "failpoints"
    failpoints.write_text("")
    replica = await start_replica(root, models.a, token, tp=2, failpoints=failpoints)
    http = aiohttp.ClientSession()
    scenario = {"root": root, "models": models, "token": token, "failpoints": failpoints}
    try:
        await wait_ready(http, replica.url)
        yield {**scenario, "replica": replica, "http": http}
    finally:
        await http.close()
        await stop_replica(replica)


async def test_tp2_push_commits_on_both_ranks(tp2: dict[str, Any]) -> None:
    replica, http = tp2["replica"], tp2["http"]
    tp2["cold_a"] = await outputs(http, replica.server)
    (result,) = await run_trainer([replica.url], tp2["token"], tp2["models"].b, "tp2-1")
    assert result["outcome"] == "committed", result
    ranks = result["ranks"]
    assert sorted(rank["rank"]["tp"] for rank in ranks) == [0, 1]
    assert all(rank["ok"] and rank["state"] == "clean" for rank in ranks)
    assert len({rank["coverageHash"] for rank in ranks}) == 1
    await wait_ready(http, replica.url)
    _, info = await call(http, replica.url, "/weight_info")
    assert info == {"weight_version": "tp2-1", "world_size": 2}
    tp2["warm_b"] = await outputs(http, replica.server)
    assert tp2["warm_b"] != tp2["cold_a"]


async def test_tp2_one_rank_refusing_fences_the_replica(tp2: dict[str, Any]) -> None:
    replica, http = tp2["replica"], tp2["http"]
    tp2["failpoints"].write_text("load@tp1")
    (result,) = await run_trainer([replica.url], tp2["token"], tp2["models"].c, "tp2-bad")
    tp2["failpoints"].write_text("")
    assert result["outcome"] == "failed", result
    assert "dp0:pp0:tp1:ep0" in result["reason"], result
    await wait_ready(http, replica.url, want=False)
    current = await state(http, replica.url)
    assert [rank["state"] for rank in current["ranks"]] == ["poisoned", "poisoned"], current
    assert (await call(http, replica.url, "/weight_info"))[1]["weight_version"] == "tp2-1"
    (again,) = await run_trainer([replica.url], tp2["token"], tp2["models"].b, "tp2-2")
    assert again["outcome"] == "committed", again
    await wait_ready(http, replica.url)
    assert await outputs(http, replica.server) == tp2["warm_b"]


async def test_tp2_cold_engine_on_the_pushed_weights_equals_the_warm_one(
    tp2: dict[str, Any],
) -> None:
    replica, http = tp2["replica"], tp2["http"]
    await replica.agent.stop()
    await replica.server.stop()
    cold = VllmServer(model=tp2["models"].b, log=tp2["root"] / "cold.log", tp=2)
    replica.server = cold
    await cold.start()
    assert await outputs(http, cold) == tp2["warm_b"]
