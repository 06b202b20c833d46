"""Server tier, trainer path, gap 3: an MLA model pushed over ``weightroll_gloo`` refreshes its
derived state (``W_UK_T``/``W_UV``), so the warm engine equals a cold engine on the pushed
weights (vLLM's own layerwise reload is broken for MLA on CPU, vllm-on-cpu.md §10).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.harness.mla import absorbed_weights
from tests.harness.models import build_tiny_model, random_checkpoint
from tests.server.conftest import Models, Scenario, stop_scenario
from tests.server.trainer_scenario import push, start_replica
from tests.server.vllm_server import VllmServer

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sc(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    root = tmp_path_factory.mktemp("trainer-mla")
    a = build_tiny_model("deepseek_v2", root / "models" / "a", seed=0)
    b = random_checkpoint(a, root / "models" / "b", seed=1)
    scenario = await start_replica(root, Models(root / "models", a, b, b))
    try:
        yield scenario
    finally:
        await stop_scenario(scenario)


async def test_mla_push_refreshes_derived_state_and_equals_a_cold_engine(sc: Scenario) -> None:
    boot = await sc.outputs()
    result = await push(sc, "mla-1", sc.models.b)
    assert result["outcome"] == "committed", result
    (rank,) = result["ranks"]
    refreshed = rank["derivedRefreshed"]
    absorbed_weights(refreshed)  # W_UK_T/W_UV, or AMX_MLA's packed copies of them
    await sc.wait_ready()
    warm = await sc.outputs()
    assert warm != boot
    await sc.agent.stop()
    await sc.server.stop()
    cold = VllmServer(model=sc.models.b, log=sc.server.log, boot_version="cold")
    sc.server = cold
    await cold.start()
    assert await sc.outputs() == warm
