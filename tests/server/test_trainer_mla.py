"""Server tier, trainer path, gap 3: an MLA model pushed over ``weightroll_gloo`` refreshes its
derived state (``W_UK_T``/``W_UV``), so the warm engine equals a cold engine on the pushed
weights (vLLM's own layerwise reload is broken for MLA on CPU, vllm-on-cpu.md §10).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.harness.mla import absorbed_weights
from tests.server.conftest import MLA_TP1, Scenario, ServerPool
from tests.server.trainer_scenario import push, trainer_scenarios

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    root = tmp_path_factory.mktemp("trainer-mla")
    async with trainer_scenarios(pool, root, MLA_TP1, cold=("b",), keep=False) as (scenario,):
        yield scenario


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
    # a fresh engine booted on B (the pool started it beside this replica)
    assert sc.cold(sc.models.b) == warm
