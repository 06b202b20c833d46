"""The whole operator (kopf handlers, indices, timer) against kmock and simulated agents."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import kopf
import pytest
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.settings import OperatorConfig

from tests.contract.rollout.harness import NS, Harness

pytestmark = pytest.mark.asyncio


async def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_operator_rolls_out_8_pods(h: Harness) -> None:
    await h.add_pods(8)
    await h.create_wu("wu", "v2", strategy={"maxUnavailable": 3})

    registry = kopf.OperatorRegistry()
    config = OperatorConfig(interval=0.1, posting_level="WARNING")
    rt = Runtime(reconciler=h.rec, config=config)
    register(registry, rt)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=h.url, insecure=True)

    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
    )
    try:
        await _wait(h.phase_is("wu", "Succeeded"), timeout=30)
        # read everything while the operator runs: kmock stalls on reads after kopf's watch
        # streams are cut at shutdown
        status = await h.status("wu")
        gates = [await h.gate(f"pod-{i}") for i in range(8)]
        annotations = (await h.wu("wu"))["metadata"].get("annotations", {})
        events = {e["reason"] for e in await h.kube.list_events(NS, "wu")}
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)

    assert status["replicas"]["verified"] == 8
    assert gates == ["True"] * 8
    for i in range(8):
        assert h.agents[f"pod-{i}"].executions == ["wu-v2"]
    h.assert_never_ready_unverified({"v2"})
    assert h.max_drained_at_once() <= 3
    # kopf keeps its progress under our prefix, never under kopf.zalando.org
    assert not any(k.startswith("kopf.zalando.org") for k in annotations)
    assert all("<" not in k for k in annotations), annotations  # valid annotation keys
    assert {"UnitDraining", "UnitVerified", "PhaseChanged"} <= events
