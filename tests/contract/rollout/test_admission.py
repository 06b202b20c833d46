"""Admission of pods no WeightUpdate selects, through the whole operator (kopf handlers and
indices) against kmock: one conditional ``pods/status`` patch sets the gate True, and nothing
else is written on the pod."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY

from tests.contract.rollout.harness import NS, Harness, running_operator, wait_until
from tests.harness.kube_fleet import make_pod

pytestmark = pytest.mark.asyncio


def fresh_pod(name: str, app: str, *, containers_ready: bool = True) -> dict[str, Any]:
    """A pod as kubelet reports it before anyone wrote our gate (the agent is not asked)."""
    body = make_pod(name, "127.0.0.1", 1, labels={"app": app}, gate=None)
    body["metadata"]["resourceVersion"] = "7"
    body["status"]["conditions"] = [
        {"type": "ContainersReady", "status": "True" if containers_ready else "False"},
        {"type": "Ready", "status": "False"},
    ]
    return body


def _pod_writes(h: Harness, *, but: tuple[str, ...] = ()) -> list[tuple[str, str | None, Any]]:
    """(pod, subresource, body) of every PATCH on a pod, except the test's own on ``but``."""
    return [
        (r.name, r.subresource, r.data)
        for r in h.emu
        if r.resource is not None
        and r.resource.plural == "pods"
        and r.method == "PATCH"
        and not (r.subresource is None and r.name in but)
    ]


async def test_unselected_ready_pod_is_admitted_once(h: Harness) -> None:
    await h.create_pod(fresh_pod("free", "free"))
    await h.create_pod(fresh_pod("late", "free", containers_ready=False))
    await h.create_pod(fresh_pod("governed", "llm"))
    await h.create_wu("wu", "v2", paused=True, agent={})  # selects app=llm; paused: touches no pod

    async with running_operator(h):
        await wait_until(lambda: _gate_is(h, "free", "True"))
        await wait_until(h.phase_is("wu", "Paused"))
        # kubelet: the agent's /readyz answers now
        path = f"/api/v1/namespaces/{NS}/pods/late"
        conds = {"conditions": [{"type": "ContainersReady", "status": "True"}]}
        async with h.http.patch(
            path,
            json={"status": conds},
            headers={"Content-Type": "application/merge-patch+json"},
        ) as resp:
            assert resp.status < 400
        await wait_until(lambda: _gate_is(h, "late", "True"))
        await asyncio.sleep(0.5)  # a few more timer passes and pod events
        governed = await h.gate("governed")
        free = await h.pod("free")

    assert governed is None, "a pod selected by a WeightUpdate is left to it"
    # exactly one accepted gate write per admitted pod (kmock's replay of the listing as ADDED
    # events may add a second attempt on the stale version, refused with 409), nothing else
    assert [w.pod for w in h.emu.status_writes] == ["free", "late"]
    writes = _pod_writes(h, but=("late",))
    assert {(pod, sub) for pod, sub, _ in writes} == {("free", "status"), ("late", "status")}
    body = writes[0][2]
    assert body["metadata"] == {"resourceVersion": "7"}  # conditional on what was read
    (cond,) = body["status"]["conditions"]
    assert cond["type"] == CONDITION_WEIGHTS_READY and cond["status"] == "True"
    assert cond["reason"] == "Admitted"
    assert cond["message"] == "Serving its boot weights: no WeightUpdate selects it"
    assert {c["type"]: c["status"] for c in free["status"]["conditions"]} == {
        "ContainersReady": "True",
        "Ready": "True",
        CONDITION_WEIGHTS_READY: "True",
    }
    assert not free["metadata"].get("finalizers") and not free["metadata"]["annotations"]
    exposed = {
        s.labels["namespace"]: s.value
        for m in h.metrics.registry.collect()
        if m.name == "weightroll_pods_admitted"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert exposed == {NS: 2.0}


async def test_switched_off_writes_nothing(h: Harness) -> None:
    await h.create_pod(fresh_pod("free", "free"))
    await h.create_wu("wu", "v2", paused=True, agent={}, selector={"matchLabels": {"app": "none"}})

    async def has_phase() -> bool:
        return bool((await h.status("wu")).get("phase"))

    async with running_operator(h, admit_unmanaged_pods=False):
        await wait_until(has_phase)  # the operator runs and has handled the WeightUpdate
        await asyncio.sleep(1.0)  # the pod's listing event has long been handled
        gate = await h.gate("free")

    assert gate is None
    assert _pod_writes(h) == []


async def test_deleting_the_weightupdate_admits_the_pods_it_never_touched(h: Harness) -> None:
    await h.create_pod(fresh_pod("governed", "llm"))
    await h.create_wu("wu", "v2", paused=True, agent={})

    async with running_operator(h):
        await wait_until(h.phase_is("wu", "Paused"))
        assert await h.gate("governed") is None
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/wu"
        async with h.http.delete(path) as resp:
            assert resp.status < 400
        await wait_until(lambda: _gate_is(h, "governed", "True"))

    assert [w.pod for w in h.emu.status_writes] == ["governed"]


async def test_deleted_weightupdate_leaves_its_untouched_pods_to_admission(h: Harness) -> None:
    """``admit_all`` (called by the delete handler after the release): pods the deleted
    WeightUpdate selected but never touched are admitted; other peers still govern theirs."""
    await h.create_pod(fresh_pod("untouched", "llm"))
    await h.create_pod(fresh_pod("other", "other"))
    await h.create_wu("wu", "v2", paused=True, agent={})
    await h.create_wu(
        "keeper", "v2", paused=True, agent={}, selector={"matchLabels": {"app": "other"}}
    )
    peers = await h.kube.list_weightupdates(NS)

    assert await h.rec.admit_all(await h.pods(), peers) == 0
    assert await h.rec.admit_all(await h.pods(), peers, gone="wu") == 1
    assert (await h.gate("untouched"), await h.gate("other")) == ("True", None)
    # the next event of the admitted pod finds nothing to do
    assert await h.rec.admit_all(await h.pods(), peers, gone="wu") == 0


async def test_a_vanished_pod_is_not_an_error(h: Harness) -> None:
    assert await h.rec.admit(fresh_pod("gone", "free"), []) is False  # 404: never created
    assert h.kube.writes["pod-status"] == 1


async def _gate_is(h: Harness, pod: str, value: str) -> bool:
    return await h.gate(pod) == value
