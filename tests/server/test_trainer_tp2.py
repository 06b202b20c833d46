"""Server tier, trainer path, TP=2: a push over ``weightroll_gloo`` reaches both ranks (each
slices the full tensors itself), both must agree before the agent answers 200, and one rank
refusing fences the whole replica. A cold TP=2 engine on the pushed weights is the oracle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP2, Scenario, ServerPool
from tests.server.trainer_scenario import call, push, trainer_scenarios, weight_version

pytestmark = [pytest.mark.server, pytest.mark.tp2, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    root = tmp_path_factory.mktemp("trainer-tp2")
    async with trainer_scenarios(pool, root, LLAMA_TP2, cold=("b",)) as (scenario,):
        yield scenario


async def test_tp2_push_commits_on_both_ranks(sc: Scenario) -> None:
    result = await push(sc, "tp2-1", sc.models.b)
    assert result["outcome"] == "committed", result
    ranks = result["ranks"]
    assert sorted(rank["rank"]["tp"] for rank in ranks) == [0, 1]
    assert all(rank["ok"] and rank["state"] == "clean" for rank in ranks)
    assert len({rank["coverageHash"] for rank in ranks}) == 1
    await sc.wait_ready()
    assert (await call(sc, "/weight_info"))[1] == {"weight_version": "tp2-1", "world_size": 2}
    sc.notes["warm_b"] = await sc.outputs()
    assert sc.notes["warm_b"] != sc.cold_a


async def test_tp2_one_rank_refusing_fences_the_replica(sc: Scenario) -> None:
    sc.set_failpoints("load@tp1")
    result = await push(sc, "tp2-bad", sc.models.c)
    sc.set_failpoints("")
    assert result["outcome"] == "failed", result
    assert "dp0:pp0:tp1:ep0" in result["reason"], result
    await sc.wait_ready(False)
    ranks = (await sc.state())["ranks"]
    assert [rank["state"] for rank in ranks] == ["poisoned", "poisoned"], ranks
    assert await weight_version(sc) == "tp2-1"
    again = await push(sc, "tp2-2", sc.models.b)
    assert again["outcome"] == "committed", again
    await sc.wait_ready()
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_tp2_cold_engine_on_the_pushed_weights_equals_the_warm_one(sc: Scenario) -> None:
    # a fresh TP=2 engine booted on B with the same flags (pool.py, "cold outputs")
    assert sc.cold(sc.models.b) == sc.notes["warm_b"]
