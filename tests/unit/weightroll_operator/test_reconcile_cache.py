"""The reconciler reuses pod views only for the very same (never mutated) pod object."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from weightroll_operator.reconcile import Reconciler

from tests.harness.kube_fleet import make_pod


def test_view_cache_is_keyed_by_object_identity() -> None:
    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    first = rec.selection.view(pod, None)
    assert rec.selection.view(pod, None) is first
    assert rec.selection.view(pod, "group") is not first  # other arguments, other view
    changed = copy.deepcopy(pod)
    changed["status"]["conditions"][0]["status"] = "False"
    assert rec.selection.view(changed, None).ready is False
    assert first.ready is True


def test_a_view_older_than_our_own_write_is_stale_until_a_newer_one_arrives() -> None:
    """The pod index lags the operator's writes (issue 11, C): a view still at the
    resourceVersion a write was planned from must not count as available or be acted on."""
    from weightroll_operator.apply import ActionResult
    from weightroll_operator.domain.actions import GateOff
    from weightroll_operator.domain.fleet import pod_view

    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    pod["metadata"]["resourceVersion"] = "7"
    before = pod_view(pod, group_by=None)
    assert rec.expectations.mark_stale((before,)) == (before,)  # nothing written yet
    rec.expectations.remember([ActionResult(GateOff(before))])
    (seen,) = rec.expectations.mark_stale((before,))
    assert seen.stale  # the write has not reached the index
    newer = copy.deepcopy(pod)
    newer["metadata"]["resourceVersion"] = "8"
    (seen,) = rec.expectations.mark_stale((pod_view(newer, group_by=None),))
    assert not seen.stale
    (seen,) = rec.expectations.mark_stale((before,))
    assert not seen.stale  # the mark is gone once a newer view was seen
    # a failed write leaves no mark
    rec.expectations.remember([ActionResult(GateOff(before), error=RuntimeError("refused"))])
    assert not rec.expectations.mark_stale((before,))[0].stale


@pytest.mark.parametrize(("produced", "stale_later"), [("8", True), ("7", False), (None, False)])
def test_a_view_older_than_a_write_that_moved_the_pod_stays_stale_past_the_window(
    produced: str | None, stale_later: bool
) -> None:
    """Found by the simulation tier: the index lagged two minutes behind a claim, the mark ran
    out after 30 s, and the next pass saw the drained pod Ready and drained another. A write
    the API server reported at a new resourceVersion keeps views at the old one stale however
    long; only a write that reported none (or the same: a no-op) runs out."""
    from weightroll_operator.apply import ActionResult
    from weightroll_operator.domain.actions import GateOff
    from weightroll_operator.domain.fleet import pod_view

    clock = [0.0]
    rec = Reconciler(kube=object(), agents=object(), monotonic=lambda: clock[0])  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    pod["metadata"]["resourceVersion"] = "7"
    before = pod_view(pod, group_by=None)
    rec.expectations.remember([ActionResult(GateOff(before), resource_version=produced)])
    assert rec.expectations.mark_stale((before,))[0].stale
    clock[0] = 120.0
    assert rec.expectations.mark_stale((before,))[0].stale is stale_later


def test_agent_backoff_is_exponential_with_jitter() -> None:
    from weightroll_operator.reconcile import backoff_delay

    assert [backoff_delay(n, 1.0, 60.0, lambda: 0.5) for n in (1, 2, 3, 7, 20)] == [
        1.0,
        2.0,
        4.0,
        60.0,
        60.0,
    ]
    assert backoff_delay(3, 1.0, 60.0, lambda: 0.0) == 2.0  # jitter: 0.5x .. 1.5x
    assert backoff_delay(3, 1.0, 60.0, lambda: 1.0) == 6.0


def test_view_cache_keeps_no_superseded_pod_object() -> None:
    """Issue 11 finding 7: one entry per pod, the newest object only."""
    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    rec.selection.view(pod, None)
    versions = [pod]
    for _ in range(50):  # every change of the pod arrives as a new object
        versions.append(copy.deepcopy(versions[-1]))
        rec.selection.view(versions[-1], None)
    assert len(rec.selection._views) == 1
    ((held, *_),) = rec.selection._views.values()
    assert held is versions[-1]
    assert not any(
        entry[0] is old for old in versions[:-1] for entry in rec.selection._views.values()
    )


def test_view_cache_is_bounded() -> None:
    rec = Reconciler(kube=object(), agents=object(), cache_limit=10)  # type: ignore[arg-type]
    for i in range(25):
        rec.selection.view(make_pod(f"p{i}", "10.0.0.1", 8470), None)
    assert len(rec.selection._views) <= 10


def test_paused_gc_suspends_collection_only_inside_and_restores_the_setting() -> None:
    """Issue 11 G: the synchronous steps of a pass run without cyclic collection (which cost
    a full-heap collection about once a pass at 10,000 pods); the setting is restored after."""
    import gc

    from weightroll_operator.reconcile import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        gc.disable()  # someone else disabled it: left disabled
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    try:
        with paused_gc():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()


def _spec(selector: dict[str, Any], group_by: str | None = None) -> Any:
    from weightroll_operator.api.v1alpha1 import WeightUpdateSpec

    body: dict[str, Any] = {"selector": selector, "version": "v2", "source": {"uri": "/w/v2"}}
    if group_by:
        body["groupBy"] = group_by
    return WeightUpdateSpec.model_validate(body)


def test_selection_memo_matches_select_pods_and_judges_each_object_once() -> None:
    """Issue 11 G: a pass judges only the pod objects it has not seen under this selection;
    what it selects is exactly :func:`select_pods` of the same objects."""
    from weightroll_operator.domain import fleet
    from weightroll_operator.domain.model import owner_key

    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    owner = owner_key("default", "wu")
    pods: list[dict[str, Any]] = [
        make_pod(f"p{i}", "10.0.0.1", 8470, labels={"app": "llm" if i % 3 else "other"})
        for i in range(9)
    ]
    pods.append(make_pod("elsewhere", "10.0.0.2", 8470, namespace="other"))
    llm = _spec({"matchLabels": {"app": "llm"}})
    judged: list[str] = []
    real = fleet.select_one

    def counting(pod: Any, *args: Any) -> Any:
        judged.append(pod["metadata"]["name"])
        return real(pod, *args)

    import weightroll_operator.reconcile.selection as selection

    selection.select_one = counting  # type: ignore[assignment]
    try:
        first = rec.selection.select(owner, pods, llm, "default").views
        assert first == fleet.select_pods(pods, llm, "default")
        assert len(judged) == len(pods)
        judged.clear()
        # the same objects: nothing judged again, the very same views (units are reused)
        assert rec.selection.select(owner, list(reversed(pods)), llm, "default").views is first
        assert judged == []
        changed = copy.deepcopy(pods[0])  # p0 now joins the selection (a new object)
        changed["metadata"]["labels"]["app"] = "llm"
        pods[0] = changed
        again = rec.selection.select(owner, pods, llm, "default").views
        assert judged == ["p0"]
        assert again == fleet.select_pods(pods, llm, "default")
        assert again[0].name == "p0"
        judged.clear()
        deleted = copy.deepcopy(pods[1])  # p1 is being deleted: left out, kept as deleting
        deleted["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
        pods[1] = deleted
        gone = rec.selection.select(owner, pods, llm, "default")
        assert "p1" not in [v.name for v in gone.views]
        assert gone.deleting == (deleted,)
        assert rec.selection.select(owner, pods, llm, "default") is gone
        judged.clear()
        other = _spec({"matchLabels": {"app": "other"}})  # another selector: judged anew
        assert rec.selection.select(owner, pods, other, "default").views == fleet.select_pods(
            pods, other, "default"
        )
        assert len(judged) == len(pods)
        judged.clear()
        grouped = _spec({"matchLabels": {"app": "other"}}, group_by="app")
        rec.selection.select(owner, pods, grouped, "default")
        assert len(judged) == len(pods)  # groupBy is part of the selection
        (held,) = rec.selection._selections.values()
        assert len(held.judged) == len(pods)  # only the objects of the last pass are kept
    finally:
        selection.select_one = real


@pytest.mark.parametrize(
    ("change", "in_place"),
    [
        ("annotate", True),  # a claim or a gate write: stays selected, replaced in place
        ("relabel-away", False),  # leaves the selection: selected anew
        ("delete", False),  # being deleted: selected anew, kept as deleting
        ("add", False),  # a new pod: selected anew
        ("remove", False),  # gone: selected anew
    ],
)
@pytest.mark.parametrize("group_by", [None, "rack"])
def test_changed_pods_give_the_selection_and_units_made_from_scratch(
    change: str, in_place: bool, group_by: str | None
) -> None:
    """Issue 11 G: when a batch of pods changes, their views are replaced in place (no
    re-sort, units rebuilt only for them); the oracle is :func:`select_pods` and
    :func:`group_units` of the same objects."""
    from weightroll_operator.domain import fleet
    from weightroll_operator.domain.model import owner_key

    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    owner = owner_key("default", "wu")
    pods: list[dict[str, Any]] = [
        make_pod(f"p{i}", "10.0.0.1", 8470, labels={"app": "llm", "rack": f"r{i % 3}"})
        for i in (7, 3, 9, 1, 5)
    ]
    llm = _spec({"matchLabels": {"app": "llm"}}, group_by=group_by)
    first = rec.selection.select(owner, pods, llm, "default")
    rec.selection.group(owner, first.views, group_by)
    pods = [copy.deepcopy(p) if i in (1, 3) else p for i, p in enumerate(pods)]
    if change == "annotate":
        pods[1]["metadata"]["annotations"] = {"weightroll.io/owner": "default/wu"}
    elif change == "relabel-away":
        pods[1]["metadata"]["labels"]["app"] = "other"
    elif change == "delete":
        pods[1]["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    elif change == "add":
        pods.append(make_pod("p0", "10.0.0.1", 8470, labels={"app": "llm", "rack": "r0"}))
    elif change == "remove":
        pods.pop(0)
    again = rec.selection.select(owner, pods, llm, "default")
    expected = fleet.select_pods(pods, llm, "default", owner=owner)
    assert again.views == expected
    assert [v.name for v in again.views] == sorted(v.name for v in again.views)
    assert (again.positions is first.positions) is in_place
    assert len(again.judged) == len(pods)
    assert rec.selection.group(owner, again.views, group_by) == fleet.group_units(expected)
    assert rec.selection.select(owner, pods, llm, "default") is again  # and nothing changed since


def test_state_key_memo_follows_the_view_object() -> None:
    from dataclasses import replace

    from weightroll_operator.domain.fleet import pod_view
    from weightroll_operator.reconcile.observe import _state_key

    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    view = pod_view(make_pod("p0", "10.0.0.1", 8470), group_by=None)
    assert rec.observer._same_key(_state_key(view), view)
    drained = replace(view, gate=False)  # our view changed: the cached answer is not valid
    assert not rec.observer._same_key(_state_key(view), drained)
    assert rec.observer._same_key(_state_key(drained), drained)


def test_group_units_reuses_only_units_of_the_very_same_views() -> None:
    from dataclasses import replace

    from weightroll_operator.domain.fleet import group_units, pod_view

    def view(name: str, group: str | None = None) -> Any:
        labels = {"app": "llm", **({"g": group} if group else {})}
        return pod_view(make_pod(name, "10.0.0.1", 8470, labels=labels), group_by="g")

    views = [view("b"), view("a"), view("c1", "c"), view("c0", "c"), view("d")]
    first = group_units(views)
    assert [(u.key, [p.name for p in u.pods]) for u in first] == [
        ("a", ["a"]),
        ("b", ["b"]),
        ("c", ["c0", "c1"]),
        ("d", ["d"]),
    ]
    known = {u.key: u for u in first}
    again = group_units(list(reversed(views)), known)
    assert again == first
    assert all(x is y for x, y in zip(again, first, strict=True))  # nothing rebuilt
    views[0] = replace(views[0], ready=False)  # b changed: a new view object
    views[3] = replace(views[3], stale=True)  # c0 changed: its group is rebuilt
    third = group_units(views, known)
    assert third == group_units(views)  # the same as without the memo
    rebuilt = {u.key for u, old in zip(third, first, strict=True) if u is not old}
    assert rebuilt == {"b", "c"}
    assert not next(u for u in third if u.key == "b").ready


def test_a_refused_spec_keeps_none_of_its_pod_objects() -> None:
    """Passes of an invalid WeightUpdate may stop until its spec changes (issue 11 finding 7:
    no pod object is held meanwhile)."""
    from weightroll_operator.domain.model import owner_key
    from weightroll_operator.errors import InvalidSpec

    class StatusOnly:
        async def patch_weightupdate_status(self, *args: Any) -> None:
            return None

    rec = Reconciler(kube=StatusOnly(), agents=object())  # type: ignore[arg-type]
    owner = owner_key("default", "wu")
    pods = [make_pod("p0", "10.0.0.1", 8470)]
    rec.selection.select(owner, pods, _spec({"matchLabels": {"app": "llm"}}), "default")
    assert owner in rec.selection._selections
    body = {
        "metadata": {"name": "wu", "namespace": "default", "generation": 1},
        "spec": {
            "selector": {"matchLabels": {"app": "llm"}},
            "version": "v2",
            "source": {"uri": "/w/v2"},
            "agent": {"port": 9999},  # not the pods' `weightroll` port
        },
    }
    with pytest.raises(InvalidSpec, match=r"spec\.agent\.port"):
        asyncio.run(rec.reconcile(body, pods))
    assert owner not in rec.selection._selections


def test_only_a_fresh_agent_answer_can_put_a_pod_into_traffic() -> None:
    """``/v1/state`` answers are cached (``state_ttl``) for pods in traffic only. A pod out of
    traffic is asked afresh every pass: the planner may gate it on from that answer (restore,
    a joining pod), and a trainer push may have started since the last one."""
    from dataclasses import replace

    from weightroll_operator.domain.fleet import pod_view
    from weightroll_operator.domain.plan import Query

    from engine_agent.protocol import AgentState, EngineState

    class CountingAgents:
        calls = 0

        async def state(self, target: Any) -> AgentState:
            self.calls += 1
            return AgentState(
                version="v2", engine_state=EngineState.CLEAN, ready=True, paused=False
            )

    agents = CountingAgents()
    rec = Reconciler(kube=object(), agents=agents, state_ttl=30.0)  # type: ignore[arg-type]
    in_traffic = pod_view(make_pod("p0", "10.0.0.1", 8470), group_by=None)
    for view, asked in ((in_traffic, 1), (replace(in_traffic, gate=False), 3)):
        agents.calls = 0
        for _ in range(3):
            asyncio.run(rec.observer.observe((view,), {"p0": Query(state=True)}, None))
        assert agents.calls == asked, view.gate
