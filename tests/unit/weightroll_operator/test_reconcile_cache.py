"""The reconciler reuses pod views only for the very same (never mutated) pod object."""

from __future__ import annotations

import copy
from typing import Any

from weightroll_operator.reconcile import Reconciler

from tests.harness.kube_fleet import make_pod


def test_view_cache_is_keyed_by_object_identity() -> None:
    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    first = rec._view(pod, None, 8470)
    assert rec._view(pod, None, 8470) is first
    assert rec._view(pod, "group", 8470) is not first  # other arguments, other view
    changed = copy.deepcopy(pod)
    changed["status"]["conditions"][0]["status"] = "False"
    assert rec._view(changed, None, 8470).ready is False
    assert first.ready is True


def test_view_cache_keeps_no_superseded_pod_object() -> None:
    """Issue 11 finding 7: one entry per pod, the newest object only."""
    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    rec._view(pod, None, 8470)
    versions = [pod]
    for _ in range(50):  # every change of the pod arrives as a new object
        versions.append(copy.deepcopy(versions[-1]))
        rec._view(versions[-1], None, 8470)
    assert len(rec._views) == 1
    ((held, *_),) = rec._views.values()
    assert held is versions[-1]
    assert not any(entry[0] is old for old in versions[:-1] for entry in rec._views.values())


def test_view_cache_is_bounded() -> None:
    rec = Reconciler(kube=object(), agents=object(), cache_limit=10)  # type: ignore[arg-type]
    for i in range(25):
        rec._view(make_pod(f"p{i}", "10.0.0.1", 8470), None, 8470)
    assert len(rec._views) <= 10
