"""Server tier, trainer path: one trainer pushes to a fleet of replicas through their agents.

Three real replicas (vLLM on model A with ``weightroll_gloo`` plus a real agent each) and one
address where no agent listens. Replica 3's rank refuses its finish (a failpoint: one rank
failing alone cannot be provoked from outside, engine-reload.md); its agent answers that
refusal exactly as for any other (fence, HTTP error). The fan-out client returns one result per
replica: committed, committed, failed (with the reason), unreachable; the failed replica stays
fenced and drained while the others serve the new version.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP1, Scenario, ServerPool
from tests.server.trainer_scenario import (
    metrics,
    push,
    run_trainer,
    token_file,
    trainer_scenarios,
    weight_version,
)
from tests.server.vllm_server import free_port

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def fleet(
    pool: ServerPool, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[Scenario]]:
    root = tmp_path_factory.mktemp("trainer-fleet")
    async with trainer_scenarios(pool, root, LLAMA_TP1, 3) as replicas:
        yield replicas


async def test_fan_out_returns_one_result_per_replica_and_fences_the_failed_one(
    fleet: list[Scenario],
) -> None:
    cold_a = await fleet[0].outputs()
    failed = fleet[2]
    failed.set_failpoints("finish")
    nowhere = f"http://127.0.0.1:{free_port()}"
    agents = [sc.agent.url for sc in fleet] + [nowhere]
    results = await run_trainer(agents, token_file(fleet[0]), fleet[0].models.b, "fleet-1")
    failed.set_failpoints("")
    assert [r["url"] for r in results] == agents
    assert [r["outcome"] for r in results] == ["committed", "committed", "failed", "unreachable"]
    assert [r["version"] for r in results[:2]] == ["fleet-1", "fleet-1"]
    assert "failpoint" in results[2]["reason"] and results[2]["code"], results[2]
    # The committed replicas serve the new weights, identically.
    for sc in fleet[:2]:
        await sc.wait_ready()
        assert await weight_version(sc) == "fleet-1"
    warm = [await sc.outputs() for sc in fleet[:2]]
    assert warm[0] == warm[1] != cold_a
    # The failed one stays fenced and drained at its old version.
    await failed.wait_ready(False)
    assert (await failed.state())["engineState"] == "poisoned"
    assert await weight_version(failed) == "v0"
    text = await metrics(failed)
    assert 'weightroll_agent_trainer_pushes_total{outcome="failed"} 1.0' in text
    assert 'weightroll_agent_committed_version_info{version="v0"} 1.0' in text
    # Once its rank is fixed, a full push brings it to the fleet's version.
    again = await push(failed, "fleet-1", failed.models.b)
    assert again["outcome"] == "committed", again
    await failed.wait_ready()
    assert await failed.outputs() == warm[0]
