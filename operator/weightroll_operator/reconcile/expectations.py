"""The pod index has not seen my write yet: views that predate the operator's own writes.

The pod index lags the operator's writes (issue 11, finding C); a view still at the
resourceVersion a write was planned from would show a pod we drained as Ready, or a pod whose
gate we restored as not yet touched. :class:`WriteExpectations` remembers, per pod, the version
each successful pod write was planned from, and flags views at that version ``stale``: such a
pod's unit gets no step and counts as unavailable until a newer view arrives. (OpenKruise keeps
the same idea as ``ResourceVersionExpectation``.)

Limitations: a write that did not report a new version (a no-op leaves it unchanged) is
trusted again after ``_STALE_FOR`` seconds; the marks are dropped wholesale past 200,000 pods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from weightroll_operator.apply import ActionResult
from weightroll_operator.domain.actions import Claim, GateOff, GateOn, Settle
from weightroll_operator.domain.model import PodView

__all__ = ["WriteExpectations"]

#: Seconds a pod view at the version our write was planned from is treated as stale when the
#: write did not report a new version (a no-op write leaves the resourceVersion unchanged, so
#: the view is trusted again after this). A write that reported a new version makes every view
#: at the old one stale for as long as the index serves it: trusting it again after 30 s let a
#: pass on an index that lagged two minutes see a pod it drained as Ready and drain another
#: (two out with a budget of 1, found by the simulation tier).
_STALE_FOR = 30.0
#: Marks kept before they are all dropped.
_MARKS_LIMIT = 200_000


@dataclass
class WriteExpectations:
    """Which pod views predate a write of ours (:meth:`remember` after apply, :meth:`mark_stale`
    before planning)."""

    #: Monotonic seconds (injected by the simulation tier).
    monotonic: Callable[[], float] = time.monotonic
    #: (namespace, pod) -> (the resourceVersion a write was planned from, whether the write
    #: reported another one, monotonic time): views at that version predate our write.
    _written: dict[tuple[str, str], tuple[str, bool, float]] = field(default_factory=dict)

    def remember(self, results: Iterable[ActionResult]) -> None:
        """Note the pod writes among ``results`` that happened (claims, gate writes, settles)."""
        now = self.monotonic()
        for result in results:
            action = result.action
            if (
                result.ok
                and isinstance(action, Claim | GateOff | GateOn | Settle)
                and action.pod.resource_version
            ):
                key = (action.pod.namespace, action.pod.name)
                read = action.pod.resource_version
                moved = result.resource_version not in (None, read)
                mark = self._written.get(key)
                if mark is None or mark[0] != read:
                    self._written[key] = (read, moved, now)
                elif moved and not mark[1]:
                    self._written[key] = (read, True, mark[2])
        if len(self._written) > _MARKS_LIMIT:
            self._written.clear()

    def mark_stale(self, views: tuple[PodView, ...]) -> tuple[PodView, ...]:
        """Flag views that predate our own last write to the pod; a mark is dropped once a view
        at another version was seen (or ``_STALE_FOR`` passed: a write that changed nothing
        keeps the version). ``views`` itself (the same object) when none is flagged."""
        if not self._written:
            return views
        now = self.monotonic()
        out = list(views)
        flagged = False
        for i, view in enumerate(views):
            key = (view.namespace, view.name)
            mark = self._written.get(key)
            if mark is not None:
                read, moved, at = mark
                if view.resource_version == read and (moved or now - at < _STALE_FOR):
                    out[i] = replace(view, stale=True)
                    flagged = True
                else:
                    del self._written[key]
        return tuple(out) if flagged else views
