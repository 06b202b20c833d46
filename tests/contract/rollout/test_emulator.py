"""The fleet emulator's shortcut through kmock's reaction matching changes no answer.

:class:`~tests.harness.kube_fleet.FleetEmulator` asks "is this request in the reaction's view?"
of the request alone (its criteria) instead of filtering the whole request log as kmock does.
Checked here against kmock's own definition (iterate the view, find the request) for every
reaction, kmock's fallbacks and one a test adds, and every request of a short session.
"""

from __future__ import annotations

import aiohttp
import kmock
import pytest

from tests.harness.kube_fleet import _CheapFilter, _CheapPriority, fleet_emulator, make_pod

pytestmark = pytest.mark.asyncio


async def test_cheap_membership_answers_as_kmock_does() -> None:
    async with fleet_emulator() as (emu, url), aiohttp.ClientSession(base_url=url) as http:
        emu[kmock.method.PATCH]["/api/v1/namespaces/default/pods/refused"] << 409 << {"code": 409}
        pods = "/api/v1/namespaces/default/pods"
        for name in ("a", "refused"):
            async with http.post(pods, json=make_pod(name, "127.0.0.1", 1)) as resp:
                assert resp.status < 400
        async with http.get(pods) as resp:
            assert resp.status == 200
        merge = {"Content-Type": "application/merge-patch+json"}
        for name, status in (("a", 200), ("refused", 409)):
            body = {"metadata": {"labels": {"x": "y"}}}
            async with http.patch(f"{pods}/{name}", json=body, headers=merge) as resp:
                assert resp.status == status
        async with http.delete(f"{pods}/a") as resp:
            assert resp.status < 400

        requests = list(emu)
        assert len(requests) == 6
        views = [payload._source for payload in emu._payloads]
        cheap = [v for v in views if isinstance(v, (_CheapFilter, _CheapPriority))]
        assert len(cheap) == len(views), "every reaction's view took the shortcut"
        matches = 0
        for view in views:
            for request in requests:
                kmocks_answer = any(seen is request for seen in view)  # View.__contains__
                assert (request in view) == kmocks_answer, (view, request)
                matches += kmocks_answer
        assert matches >= len(requests)  # each request was served by some reaction
