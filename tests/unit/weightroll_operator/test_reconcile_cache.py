"""The reconciler reuses pod views only for the very same (never mutated) pod object."""

from __future__ import annotations

import copy
from typing import Any

from weightroll_operator.reconcile import Reconciler

from tests.harness.kube_fleet import make_pod


def test_view_cache_is_keyed_by_object_identity() -> None:
    rec = Reconciler(kube=object(), agents=object())  # type: ignore[arg-type]
    pod: dict[str, Any] = make_pod("p0", "10.0.0.1", 8470)
    first = rec._view(pod, None)
    assert rec._view(pod, None) is first
    assert rec._view(pod, "group") is not first  # other arguments, other view
    changed = copy.deepcopy(pod)
    changed["status"]["conditions"][0]["status"] = "False"
    assert rec._view(changed, None).ready is False
    assert first.ready is True
