"""The operator's pod watch is scoped server-side by a label selector when one is configured
(issue 11 finding 7). (Namespaces: ``weightroll-operator -n NS`` makes kopf watch only those;
kmock cannot serve kopf's namespace listing, so that part is kopf's own and not re-tested here.)"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import kopf
import pytest
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.settings import OperatorConfig

from tests.contract.rollout.harness import Harness, wait_until

pytestmark = pytest.mark.asyncio


async def _pod_watches(h: Harness, *, config: OperatorConfig, **kw: Any) -> list[Any]:
    registry = kopf.OperatorRegistry()
    register(registry, Runtime(reconciler=h.rec, config=config))

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=h.url, insecure=True)

    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(registry=registry, standalone=True, stop_flag=stop, **kw)
    )
    try:

        async def pod_reads() -> list[Any]:
            return [
                r
                for r in h.emu
                if r.resource is not None and r.resource.plural == "pods" and r.method == "GET"
            ]

        watches: list[Any] = await wait_until(pod_reads, what="kopf never listed or watched pods")
        return watches
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)


async def test_pod_watch_carries_the_label_selector(h: Harness) -> None:
    config = OperatorConfig(interval=0.1, pod_selector="app=llm")
    requests = await _pod_watches(h, config=config, clusterwide=True)
    assert requests and all(r.params.get("labelSelector") == "app=llm" for r in requests)


async def test_without_a_selector_the_pod_watch_is_unfiltered(h: Harness) -> None:
    requests = await _pod_watches(h, config=OperatorConfig(interval=0.1), clusterwide=True)
    assert requests and all("labelSelector" not in r.params for r in requests)
