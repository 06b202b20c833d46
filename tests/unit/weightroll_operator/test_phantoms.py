"""``phantoms.py``: indexed pods the API server no longer has (issue 27 item 5)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from weightroll_operator.errors import KubeUnavailable
from weightroll_operator.phantoms import Phantoms

from tests.unit.weightroll_operator.builders import pod

pytestmark = pytest.mark.asyncio


class _ApiServer:
    """An in-memory ``PodReader``: the pods that exist, by name -> uid."""

    def __init__(self, pods: dict[str, str], *, down: bool = False) -> None:
        self.pods, self.down, self.reads = pods, down, 0

    async def find_pod(self, namespace: str, name: str) -> Any:
        self.reads += 1
        if self.down:
            raise KubeUnavailable(0, "connection refused")
        if name not in self.pods:
            return None
        return {"metadata": {"name": name, "namespace": namespace, "uid": self.pods[name]}}


def _raw(name: str, uid: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid}}


async def test_a_pod_confirmed_gone_is_left_out_until_one_is_created_again() -> None:
    api = _ApiServer({"p1": "u1"})
    phantoms = Phantoms(api, ttl=30.0, clock=lambda: 0.0)
    gone = await phantoms.confirm_gone([replace(pod("p0"), uid="u0"), replace(pod("p1"), uid="u1")])
    assert gone == {"p0"}
    index = [_raw("p0", "u0"), _raw("p1", "u1")]
    assert [p["metadata"]["name"] for p in phantoms.live(index)] == ["p1"]
    # created again under the name: another uid, seen as usual
    assert phantoms.live([_raw("p0", "u0-new")]) == [_raw("p0", "u0-new")]


async def test_another_uid_under_the_name_is_gone_too_and_an_error_is_no_evidence() -> None:
    phantoms = Phantoms(_ApiServer({"p0": "u0-new"}), ttl=30.0, clock=lambda: 0.0)
    assert await phantoms.confirm_gone([replace(pod("p0"), uid="u0")]) == {"p0"}
    down = Phantoms(_ApiServer({}, down=True), ttl=30.0, clock=lambda: 0.0)
    assert await down.confirm_gone([replace(pod("p0"), uid="u0")]) == frozenset()
    assert down.live([_raw("p0", "u0")]) == [_raw("p0", "u0")]


async def test_a_pod_is_asked_about_at_most_once_per_ttl() -> None:
    now = [0.0]
    api = _ApiServer({"p0": "u0"})
    phantoms = Phantoms(api, ttl=30.0, clock=lambda: now[0])
    view = replace(pod("p0"), uid="u0")
    for _ in range(3):
        assert await phantoms.confirm_gone([view]) == frozenset()
    assert api.reads == 1
    now[0] = 31.0
    await phantoms.confirm_gone([view])
    assert api.reads == 2


async def test_without_a_reader_every_indexed_pod_is_present() -> None:
    phantoms = Phantoms(None, ttl=30.0)
    assert await phantoms.confirm_gone([replace(pod("p0"), uid="u0")]) == frozenset()
