"""Fixtures of the rollout contract tests: kmock playing the API server and kubelet, simulated
agents as real HTTP servers, and the operator's real clients and reconciler.

Every test here runs on virtual time (looptime, as kopf's own tests do): the event loop's clock
jumps to the next timer whenever nothing is ready to run, so the operator's intervals, backoffs,
unit timeouts and kopf's own delays cost no wall-clock time, yet fire in the order they would.
I/O and thread work take zero virtual time. ``pytest --no-looptime`` runs them on the real clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.contract.rollout.harness import Harness
from tests.harness.fake_agent import FakeFleetAgents
from tests.harness.kube_fleet import fleet_emulator

_TIER = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The hook sees the whole session's items: mark only this tier's.
    for item in items:
        if item.path.is_relative_to(_TIER):
            item.add_marker(pytest.mark.looptime)


@pytest_asyncio.fixture()
async def h() -> AsyncIterator[Harness]:
    async with fleet_emulator() as (emulator, url):
        agents = FakeFleetAgents(token="s3cret")
        harness = Harness(emulator, url, agents)
        try:
            yield harness
        finally:
            await harness.close()
