"""Fixtures of the rollout contract tests: kmock playing the API server and kubelet, simulated
agents as real HTTP servers, and the operator's real clients and reconciler."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.contract.rollout.harness import Harness
from tests.harness.fake_agent import FakeFleetAgents
from tests.harness.kube_fleet import fleet_emulator


@pytest_asyncio.fixture()
async def h() -> AsyncIterator[Harness]:
    async with fleet_emulator() as (emulator, url):
        agents = FakeFleetAgents(token="s3cret")
        harness = Harness(emulator, url, agents)
        try:
            yield harness
        finally:
            await harness.close()
