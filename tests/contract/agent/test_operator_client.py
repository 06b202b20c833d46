"""Contract: the operator's ``AgentClient`` against the real sidecar (in process, fake vLLM).

The operator and the agent share only ``engine_agent.protocol``; this checks that what the
sidecar serves parses on the operator side and that HTTP errors map to the operator's error
classes (house style rule 16 (ii): agent_client against an in-process sidecar).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from engine_agent.protocol import SourceSpec, UpdatePhase, UpdateRequest
from tests.contract.agent.conftest import TOKEN, AgentHarness

client_module = pytest.importorskip("weightroll_operator.agent_client")
errors = pytest.importorskip("weightroll_operator.errors")
ports = pytest.importorskip("weightroll_operator.ports")

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def client() -> AsyncIterator[object]:
    agent_client = client_module.AgentClient(timeout=5)
    yield agent_client
    await agent_client.close()


def _request(update_id: str, version: str, source: Path) -> UpdateRequest:
    return UpdateRequest(id=update_id, version=version, source=SourceSpec(uri=str(source)))


async def test_operator_client_drives_an_update(
    harness: AgentHarness, client: object, checkpoints: dict[str, Path]
) -> None:
    target = ports.AgentTarget(pod="pod-0", base_url=harness.url, token=TOKEN)
    state = await client.state(target)  # type: ignore[attr-defined]
    assert state.ready and state.version == "v0"
    assert await client.get_update(target, "u-1") is None  # type: ignore[attr-defined]
    await client.start_update(target, _request("u-1", "v1", checkpoints["v1"]))  # type: ignore[attr-defined]
    for _ in range(200):
        status = await client.get_update(target, "u-1")  # type: ignore[attr-defined]
        if status is not None and status.phase.terminal:
            break
        await asyncio.sleep(0.02)
    assert status is not None and status.phase is UpdatePhase.COMMITTED
    assert status.verdict is not None and status.verdict.committed
    state = await client.state(target)  # type: ignore[attr-defined]
    assert state.version == "v1" and state.ready


async def test_operator_client_maps_agent_errors(
    harness: AgentHarness, client: object, checkpoints: dict[str, Path]
) -> None:
    wrong = ports.AgentTarget(pod="pod-0", base_url=harness.url, token="nope")
    with pytest.raises(errors.AgentUnauthorized):
        await client.state(wrong)  # type: ignore[attr-defined]
    target = ports.AgentTarget(pod="pod-0", base_url=harness.url, token=TOKEN)
    gate = harness.fake.gate("weightroll_load")
    await client.start_update(target, _request("u-1", "v1", checkpoints["v1"]))  # type: ignore[attr-defined]
    await harness.fake.entered["weightroll_load"].wait()
    with pytest.raises(errors.AgentConflict) as info:
        await client.start_update(target, _request("u-2", "v2", checkpoints["v2"]))  # type: ignore[attr-defined]
    assert info.value.active_id == "u-1"
    await client.abort_update(target, "u-1")  # type: ignore[attr-defined]
    gate.set()
    for _ in range(200):
        status = await client.get_update(target, "u-1")  # type: ignore[attr-defined]
        if status is not None and status.phase.terminal:
            break
        await asyncio.sleep(0.02)
    assert status is not None and status.phase is UpdatePhase.ABORTED
    await client.abort_update(target, "unknown")  # type: ignore[attr-defined]  # 404 is fine
    down = ports.AgentTarget(pod="pod-1", base_url="http://127.0.0.1:1", token=TOKEN)
    with pytest.raises(errors.AgentUnavailable):
        await client.state(down)  # type: ignore[attr-defined]
