"""Leader election on a Lease (issue 11 F): one holder at a time, takeover only after the
record stood still for the lease duration on the candidate's own clock, clean hand-over.

The fake Lease API answers like the API server: a PUT with a stale ``resourceVersion`` gets
409, a create of an existing Lease 409, a missing Lease 404.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from weightroll_operator.errors import KubeConflict, KubeNotFound
from weightroll_operator.k8s.lease import LeaderElector


class FakeLeases:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    async def get_lease(self, namespace: str, name: str) -> Any:
        if self.lease is None:
            raise KubeNotFound(404, "not found")
        return copy.deepcopy(self.lease)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> Any:
        if self.lease is not None:
            raise KubeConflict(409, "already exists")
        return self._store(body)

    async def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> Any:
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise KubeConflict(409, "the object has been modified")
        return self._store(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pair(api: FakeLeases, clock: Clock) -> tuple[LeaderElector, LeaderElector]:
    def one(identity: str) -> LeaderElector:
        return LeaderElector(api, "ops", "weightroll-operator", identity, 15.0, clock=clock)

    return one("pod-a"), one("pod-b")


@pytest.mark.asyncio
async def test_one_holder_and_takeover_only_after_expiry() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = _pair(api, clock)
    assert await a.try_acquire() is True
    assert await b.try_acquire() is False  # first sight of a's record
    clock.now += 14
    assert await b.try_acquire() is False  # not expired on b's clock
    assert await a.try_acquire() is True  # renewal: a new record
    clock.now += 14
    assert await b.try_acquire() is False  # the renewal restarted b's count
    clock.now += 15  # a stopped renewing: its record stood still for 15 s
    assert await b.try_acquire() is True
    assert api.lease is not None
    spec = api.lease["spec"]
    assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 1
    assert await a.try_acquire() is False  # the old holder sees it lost


@pytest.mark.asyncio
async def test_concurrent_candidates_never_both_win() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = _pair(api, clock)
    won = await asyncio.gather(a.try_acquire(), b.try_acquire())
    assert sorted(won) == [False, True]


@pytest.mark.asyncio
async def test_release_hands_over_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = _pair(api, clock)
    assert await a.try_acquire()
    await a.release()
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == ""
    assert await b.try_acquire() is True  # no waiting for expiry


@pytest.mark.asyncio
async def test_a_holder_stops_within_its_deadline_when_renewals_hang() -> None:
    """A renewal that never answers (a slow API server) must not keep the holder acting past
    its renew deadline: the standby takes the Lease once it expires, and both would act."""
    api = FakeLeases()
    a = LeaderElector(
        api, "ops", "weightroll-operator", "pod-a", 15.0, renew_seconds=0.01, renew_deadline=0.2
    )
    assert await a.try_acquire()

    async def hang(*_: Any) -> Any:
        await asyncio.sleep(3600)

    api.get_lease = hang  # type: ignore[method-assign]
    await asyncio.wait_for(a.hold(), 5.0)  # returned: it stopped, instead of waiting forever


@pytest.mark.asyncio
async def test_writes_stop_at_the_renew_deadline_before_any_takeover() -> None:
    """Issue 27 item 12: an old leader wrote status up to 3.5 s after losing the Lease (5 s
    margin), because its writes stopped only when kopf's shutdown got to them. The write fence
    (``acting_for``) is down from the renew deadline on, counted from the start of the last
    renewal: before the standby may take the Lease, on the standby's own clock."""
    api, clock = FakeLeases(), Clock()
    a, b = _pair(api, clock)
    assert a.acting_for() == 0.0  # not the leader yet: no writes
    assert await a.try_acquire()
    assert a.acting_for() == pytest.approx(10.0)  # renew_deadline (2/3 of 15 s)
    assert not await b.try_acquire()  # the standby first sees the record now
    clock.now += 10.0
    assert a.acting_for() == 0.0  # the old leader's writes stop here ...
    clock.now += 4.9
    assert not await b.try_acquire()  # ... 5 s before the standby may take over
    clock.now += 0.2
    assert await b.try_acquire()
    assert a.acting_for() == 0.0


@pytest.mark.asyncio
async def test_a_fenced_client_sends_no_write_but_the_leases() -> None:
    """Once the fence is down, a status patch is refused unsent (nothing listens at the
    address: a sent request would fail differently), and a Lease write still goes out."""
    from weightroll_operator.errors import KubeUnavailable
    from weightroll_operator.k8s.client import KubeApi, KubeConfig

    kube = KubeApi(KubeConfig(server="http://127.0.0.1:9"), timeout=2.0)
    kube.fence = lambda: 0.0
    try:
        with pytest.raises(KubeUnavailable, match="no longer holds the leader Lease"):
            await kube.patch_weightupdate_status("ns", "wu", {"phase": "Failed"})
        assert kube.writes == {}
        with pytest.raises(KubeUnavailable) as lease_write:
            await kube.replace_lease("ops", "weightroll-operator", {"metadata": {}})
        assert "leader Lease" not in str(lease_write.value)  # sent: connection refused
    finally:
        await kube.close()
