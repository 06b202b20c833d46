"""Server tier, TP=2: all-rank agreement on a real tensor-parallel vLLM server on CPU.

The pooled TP=2 server (reset to model A labelled v0; ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
Tests run in file order and share it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP2, Scenario, ServerPool, scenarios

pytestmark = [pytest.mark.server, pytest.mark.tp2, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    async with scenarios(pool, tmp_path_factory.mktemp("tp2"), LLAMA_TP2) as (scenario,):
        yield scenario


async def test_happy_path_tp2_every_rank_commits(sc: Scenario) -> None:
    cold_a = sc.cold_a
    await sc.post_update("tp2-b", "v1", sc.models.b)
    status = await sc.wait_phase("tp2-b")
    assert status["phase"] == "Committed", status
    ranks = status["ranks"]
    assert sorted(rank["rank"]["tp"] for rank in ranks) == [0, 1]
    assert all(rank["ok"] and rank["state"] == "clean" for rank in ranks)
    assert len({rank["coverageHash"] for rank in ranks}) == 1
    assert all(rank["digest"] and rank["bytesLoaded"] > 0 for rank in ranks)
    assert {"drain", "begin", "load", "finish", "verify", "resume"} <= set(status["timings"])
    await sc.wait_ready()
    state = await sc.state()
    assert [rank["state"] for rank in state["ranks"]] == ["clean", "clean"]
    assert await sc.outputs() != cold_a
    # Back to A: the warm engine equals the cold boot engine of A, bit for bit.
    await sc.post_update("tp2-a", "v0b", sc.models.a)
    assert (await sc.wait_phase("tp2-a"))["phase"] == "Committed"
    assert await sc.outputs() == cold_a


async def test_one_rank_cannot_read_its_part_tp2(sc: Scenario) -> None:
    sc.set_failpoints("load@tp1")
    await sc.post_update("tp2-unreadable", "v2", sc.models.c)
    status = await sc.wait_phase("tp2-unreadable")
    assert status["phase"] == "Failed", status
    reasons = status["verdict"]["reasons"]
    assert any(
        reason.startswith("source_unavailable:") and "dp0:pp0:tp1:ep0" in reason
        for reason in reasons
    ), reasons
    assert await sc.vllm_paused()
    body = await sc.wait_ready(False)
    assert any("source_unavailable" in reason for reason in body["reasons"]), body
    state = await sc.state()
    # tp0 wrote live bytes before the agent aborted the session: poisoned, never ready.
    assert state["engineState"] == "poisoned", state
    await sc.recover("tp2-after-unreadable")
