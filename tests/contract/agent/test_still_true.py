"""The agent fences a replica whose rank says its committed weights changed (issue 26 E).

The rank's guard (engine_agent/reload/guard.py; the real-engine test is
tests/engine/test_still_true.py) poisons a rank with ``still_true_violated: ...``. The agent
must then hold the replica under that code (not the generic ``engine_not_clean``), report it
not ready, and export ``weightroll_agent_still_true_violated 1`` for the alert
WeightrollReplicaWeightsChanged; a full update clears all three.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_agent.reload import session
from tests.contract.agent.conftest import start_harness, stop_harness, update_body
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

REASON = "still_true_violated: model.norm.weight: content changed since the commit"


async def _gauge(harness: object) -> str:
    text = await (await harness.get("/metrics")).text()  # type: ignore[attr-defined]
    (line,) = [
        row for row in text.splitlines() if row.startswith("weightroll_agent_still_true_violated ")
    ]
    return line.split()[1]


async def test_a_changed_commit_holds_the_replica_until_a_full_update(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    agent = await start_harness(fake, token_file, tmp_path / "state")
    try:
        await agent.submit(update_body("u-1", "v1", checkpoints["v1"]))
        await agent.wait_phase("u-1")
        await agent.wait_ready()
        assert await _gauge(agent) == "0.0"
        fake.ranks[-1].ws = session.poison(fake.ranks[-1].ws, REASON)
        body = await agent.wait_ready(False)
        assert any(r.startswith("held: still_true_violated") for r in body["reasons"]), body
        assert any("model.norm.weight" in r for r in body["reasons"]), body
        assert await _gauge(agent) == "1.0"
        await agent.submit(update_body("u-2", "v2", checkpoints["v2"]))
        await agent.wait_phase("u-2")
        await agent.wait_ready()
        assert await _gauge(agent) == "0.0"
    finally:
        await stop_harness(agent)
