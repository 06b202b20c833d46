"""Server tier, trainer path: one trainer pushes to a fleet of replicas through their agents.

Three real replicas (vLLM on model A with ``weightroll_gloo`` plus a real agent each) and one
address where no agent listens. Replica 3's rank refuses its finish (a failpoint: one rank
failing alone cannot be provoked from outside, engine-reload.md); its agent answers that
refusal exactly as for any other (fence, HTTP error). The fan-out client returns one result per
replica: committed, committed, failed (with the reason), unreachable; the failed replica stays
fenced and drained while the others serve the new version.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.server.conftest import TOKEN, build_models
from tests.server.trainer_scenario import (
    Replica,
    call,
    outputs,
    run_trainer,
    start_replica,
    state,
    stop_replica,
    wait_ready,
)
from tests.server.vllm_server import free_port

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-fleet")
    models = build_models(root / "models")
    token = root / "token"
    token.write_text(TOKEN)
    replicas: list[Replica] = []
    http = aiohttp.ClientSession()
    try:
        for i in range(3):
            failpoints = root / f"failpoints-{i}"
            failpoints.write_text("finish=error" if i == 2 else "")
            replicas.append(
                await start_replica(root / f"r{i}", models.a, token, failpoints=failpoints)
            )
        for replica in replicas:
            await wait_ready(http, replica.url)
        yield {"models": models, "token": token, "replicas": replicas, "http": http}
    finally:
        await http.close()
        await asyncio.gather(*(stop_replica(r) for r in replicas))


async def test_fan_out_returns_one_result_per_replica_and_fences_the_failed_one(
    fleet: dict[str, Any],
) -> None:
    replicas: list[Replica] = fleet["replicas"]
    http: aiohttp.ClientSession = fleet["http"]
    cold_a = await outputs(http, replicas[0].server)
    nowhere = f"http://127.0.0.1:{free_port()}"
    token: Path = fleet["token"]
    results = await run_trainer(
        [r.url for r in replicas] + [nowhere], token, fleet["models"].b, "fleet-1"
    )
    assert [r["url"] for r in results] == [r.url for r in replicas] + [nowhere]
    assert [r["outcome"] for r in results] == ["committed", "committed", "failed", "unreachable"]
    assert [r["version"] for r in results[:2]] == ["fleet-1", "fleet-1"]
    assert "failpoint" in results[2]["reason"] and results[2]["code"], results[2]
    # The committed replicas serve the new weights, identically.
    for replica in replicas[:2]:
        await wait_ready(http, replica.url)
        assert (await call(http, replica.url, "/weight_info"))[1]["weight_version"] == "fleet-1"
    warm = [await outputs(http, r.server) for r in replicas[:2]]
    assert warm[0] == warm[1] != cold_a
    # The failed one stays fenced and drained at its old version.
    failed = replicas[2]
    await wait_ready(http, failed.url, want=False)
    assert (await state(http, failed.url))["engineState"] == "poisoned"
    assert (await call(http, failed.url, "/weight_info"))[1]["weight_version"] == "v0"
    metrics = await (await http.get(f"{failed.url}/metrics")).text()
    assert 'weightroll_agent_trainer_pushes_total{outcome="failed"} 1.0' in metrics
    assert 'weightroll_agent_committed_version_info{version="v0"} 1.0' in metrics
    # Once its rank is fixed, a full push brings it back to the fleet's version.
    (failed.server.failpoints_file or Path("/nonexistent")).write_text("")
    (again,) = await run_trainer([failed.url], token, fleet["models"].b, "fleet-1")
    assert again["outcome"] == "committed", again
    await wait_ready(http, failed.url)
    assert await outputs(http, failed.server) == warm[0]
