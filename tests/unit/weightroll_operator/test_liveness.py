"""Issue 14 D: the liveness probe fails on a stalled reconcile loop (and only then).

Table tests of the pure rule (injected monotonic times), then the operator's registered
``@kopf.on.probe`` handler behind kopf's own liveness endpoint: a stall answers 500, so the
kubelet's httpGet probe fails and restarts the operator.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import kopf
import pytest
from kopf._core.engines.probing import health_reporter
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.liveness import Liveness, Stalled
from weightroll_operator.reconcile import Reconciler
from weightroll_operator.settings import OperatorConfig

from tests.harness.ports import free_port


@pytest.mark.parametrize(
    ("last_pass", "active_since", "active", "now", "stalled"),
    [
        (0.0, None, False, 10_000.0, False),  # no WeightUpdates: nothing to pass over
        (0.0, 0.0, True, 60.0, False),  # exactly at the limit (12 x 5 s)
        (0.0, 0.0, True, 60.1, True),  # past it
        (100.0, 0.0, True, 150.0, False),  # a recent pass
        (0.0, 500.0, True, 550.0, False),  # WeightUpdates appeared recently: clock starts then
        (0.0, 500.0, True, 561.0, True),
    ],
)
def test_stall_rule(
    last_pass: float, active_since: float | None, active: bool, now: float, stalled: bool
) -> None:
    live = Liveness(interval=5.0, multiple=12.0, last_pass=last_pass, active_since=active_since)
    if stalled:
        with pytest.raises(Stalled, match="no reconcile pass finished"):
            live.check(active=active, now=now)
    else:
        assert live.check(active=active, now=now) == round(now - last_pass, 1)


def test_first_sight_of_weightupdates_starts_the_clock() -> None:
    live = Liveness(interval=1.0, multiple=3.0, last_pass=0.0)
    live.check(active=True, now=1000.0)  # after an idle hour: not a stall
    with pytest.raises(Stalled):
        live.check(active=True, now=1003.5)
    live.passed(1003.6)
    assert live.check(active=True, now=1004.0) == 0.4


def test_zero_multiple_disables_the_check() -> None:
    live = Liveness(interval=1.0, multiple=0.0, last_pass=0.0, active_since=0.0)
    assert live.check(active=True, now=1e6) == 1e6


async def _probe(rt: Runtime, updates: dict[str, list[Any]]) -> int:
    registry = kopf.OperatorRegistry()
    register(registry, rt)
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(
        health_reporter(
            f"http://127.0.0.1:{port}/healthz",
            memo=kopf.Memo(),
            indices={"updates_by_namespace": updates},  # type: ignore[arg-type]
            registry=registry,
            settings=kopf.OperatorSettings(),
            ready_flag=ready,
        )
    )
    try:
        await ready.wait()
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/healthz") as resp,
        ):
            return resp.status
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _runtime(last_pass_age: float) -> Runtime:
    rt = Runtime(
        reconciler=Reconciler(kube=object(), agents=object()),  # type: ignore[arg-type]
        config=OperatorConfig(interval=5.0, liveness_stall_intervals=12.0),
    )
    rt.liveness.last_pass -= last_pass_age
    rt.liveness.active_since = rt.liveness.last_pass
    return rt


@pytest.mark.asyncio
async def test_stalled_loop_fails_kopfs_liveness_endpoint() -> None:
    wu = {"metadata": {"name": "wu", "namespace": "ns"}}
    assert await _probe(_runtime(5.0), {"ns": [wu]}) == 200
    assert await _probe(_runtime(61.0), {"ns": [wu]}) == 500  # stalled: 61 s > 12 x 5 s
    assert await _probe(_runtime(61.0), {}) == 200  # no WeightUpdates: nothing to pass over
    # Only a WeightUpdate being deleted (kopf stopped its loop; its release waits on an agent):
    # not a stall. Restarting the operator would not help it, and every restart fails over.
    from weightroll_operator.domain.fleet import trim_weightupdate  # what the index holds

    marked = {"metadata": {**wu["metadata"], "deletionTimestamp": "2026-12-01T12:00:00Z"}}
    deleting = trim_weightupdate(marked)
    assert await _probe(_runtime(61.0), {"ns": [deleting]}) == 200
    assert await _probe(_runtime(61.0), {"ns": [deleting, wu]}) == 500
