"""Server tier, trainer path, gap 3: an MLA model pushed over ``weightroll_gloo`` refreshes its
derived state (``W_UK_T``/``W_UV``), so the warm engine equals a cold engine on the pushed
weights (vLLM's own layerwise reload is broken for MLA on CPU, vllm-on-cpu.md §10).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.harness.models import build_tiny_model, random_checkpoint
from tests.server.conftest import TOKEN
from tests.server.trainer_scenario import (
    outputs,
    run_trainer,
    start_replica,
    stop_replica,
    wait_ready,
)
from tests.server.vllm_server import VllmServer

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mla(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-mla")
    a = build_tiny_model("deepseek_v2", root / "a", seed=0)
    b = random_checkpoint(a, root / "b", seed=1)
    token = root / "token"
    token.write_text(TOKEN)
    replica = await start_replica(root, a, token)
    http = aiohttp.ClientSession()
    try:
        await wait_ready(http, replica.url)
        yield {"a": a, "b": b, "root": root, "token": token, "replica": replica, "http": http}
    finally:
        await http.close()
        await stop_replica(replica)


async def test_mla_push_refreshes_derived_state_and_equals_a_cold_engine(
    mla: dict[str, Any],
) -> None:
    replica, http = mla["replica"], mla["http"]
    boot = await outputs(http, replica.server)
    (result,) = await run_trainer([replica.url], mla["token"], mla["b"], "mla-1")
    assert result["outcome"] == "committed", result
    (rank,) = result["ranks"]
    refreshed = rank["derivedRefreshed"]
    assert "model.layers.0.self_attn.mla_attn.mla_attn.W_UK_T" in refreshed, refreshed
    assert "model.layers.0.self_attn.mla_attn.mla_attn.W_UV" in refreshed, refreshed
    await wait_ready(http, replica.url)
    warm = await outputs(http, replica.server)
    assert warm != boot
    await replica.agent.stop()
    await replica.server.stop()
    cold = VllmServer(model=mla["b"], log=mla["root"] / "cold.log", boot_version="cold")
    await cold.start()
    try:
        assert await outputs(http, cold) == warm
    finally:
        await cold.stop()
