"""Reuse of what a pass derives from unchanged pod objects: views, selection, units, queries.

The kopf index (like a watch) hands over a new object for every change and never mutates one,
so object identity is a change token: a pod object seen before keeps its view, its verdict
under the same selection, its unit and the agent queries made for it. Every memo here returns
exactly what the pure function (``pod_view``, ``select_pods``, ``group_units``, ``queries``)
returns for the same objects; at 10,000 pods it saves most of a pass (issue 11 G).

Limitations: entries are per pod (namespace, name) or per WeightUpdate, never per object, so a
superseded pod object is never kept (issue 11 finding 7); the view cache is emptied when it
reaches ``cache_limit`` entries (pods that vanished leave theirs behind until then).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.domain.fleet import Unit, group_units, pod_view, select_one
from weightroll_operator.domain.model import OwnerKey, PodView
from weightroll_operator.domain.plan import Query, queries, target_source

__all__ = ["Selection", "SelectionMemo"]


@dataclass(frozen=True, slots=True)
class Selection:
    """One pass's selection of a WeightUpdate's pods (:meth:`SelectionMemo.select`)."""

    #: What it was made with: (namespace, selector, groupBy).
    signature: tuple[Any, ...]
    #: By ``id()`` of each pod object given: (the object, its view, or None when not selected).
    judged: dict[int, tuple[Mapping[str, Any], PodView | None]]
    #: The selected pods' views, by name.
    views: tuple[PodView, ...]
    #: Pod objects left out because they are being deleted (``terminating_units`` reads them).
    deleting: tuple[Mapping[str, Any], ...]
    #: The pod object of each view (same order), and each view's position by pod name.
    objects: tuple[Mapping[str, Any], ...]
    positions: dict[str, int]


#: The views a WeightUpdate's last pass grouped, the units and the units by key.
_Grouped = tuple[tuple[PodView, ...], tuple[Unit, ...], dict[str, Unit] | None]
_NO_HIT: tuple[None, None] = (None, None)


@dataclass
class SelectionMemo:
    """The memos of views, selections, units and queries, for any number of WeightUpdates."""

    #: Entries of the view cache before it is emptied (pods that vanished leave theirs behind).
    cache_limit: int = 100_000
    #: Per pod (namespace, name): the last pod object, the groupBy and its view.
    _views: dict[tuple[str, str], tuple[Mapping[str, Any], str | None, PodView]] = field(
        default_factory=dict
    )
    #: Per WeightUpdate: its last pass's selection. Rebuilt when a pod object changed, so it
    #: holds only the objects the last pass was given.
    _selections: dict[OwnerKey, Selection] = field(default_factory=dict)
    #: Per WeightUpdate: the views its last pass asked agents about, with the version, source
    #: and retry mark of that pass, and the queries (:meth:`queries`).
    _asked: dict[OwnerKey, tuple[tuple[PodView, ...], tuple[Any, ...], Mapping[str, Query]]] = (
        field(default_factory=dict)
    )
    #: Per WeightUpdate: what its last pass grouped (``group_units`` reuses the units whose
    #: views are the same objects).
    _units: dict[OwnerKey, _Grouped] = field(default_factory=dict)

    def forget(self, owner: OwnerKey) -> None:
        """Keep none of ``owner``'s pod objects (its spec was refused, or it was deleted)."""
        self._selections.pop(owner, None)
        self._units.pop(owner, None)
        self._asked.pop(owner, None)

    def view(self, pod: Mapping[str, Any], group_by: str | None) -> PodView:
        """:func:`pod_view`, reused while the *same* pod object is passed again.

        One entry per pod (namespace, name): a new object of the pod replaces the old one, so
        superseded pod objects are never kept (issue 11 finding 7); the cache holds at most the
        live pods plus those deleted since it was last emptied.
        """
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        cached = self._views.get(key)
        if cached is not None and cached[0] is pod and cached[1] == group_by:
            return cached[2]
        if cached is None and len(self._views) >= self.cache_limit:
            self._views.clear()
        result = pod_view(pod, group_by=group_by)
        self._views[key] = (pod, group_by, result)
        return result

    def select(
        self,
        owner: OwnerKey,
        pods: list[Mapping[str, Any]],
        spec: WeightUpdateSpec,
        namespace: str,
    ) -> Selection:
        """:func:`~weightroll_operator.domain.fleet.select_pods`, judging each pod object once.

        A pod object seen by the previous pass of this WeightUpdate, under the same selection,
        keeps its verdict and view; at 10,000 pods this is most of them, and the selector is not
        evaluated again. When no pod object changed at all (most passes while units are in
        flight: only agents move), the previous selection is returned as it is, the same tuple
        of views included, so the units grouped from it are reused too; when only selected pods
        changed and stay selected (a batch claimed or restored), their views replace the old
        ones in place.
        """
        signature = (namespace, spec.selector, spec.group_by)
        previous = self._selections.get(owner)
        if previous is not None and previous.signature != signature:
            previous = None
        known = previous.judged if previous is not None else {}
        if previous is not None and len(pods) == len(known):
            changed = [pod for pod in pods if (known.get(id(pod)) or _NO_HIT)[0] is not pod]
            if not changed:
                return previous
            replaced = self._reselect(previous, changed, spec, namespace, owner)
            if replaced is not None:
                self._selections[owner] = replaced
                return replaced
        judged: dict[int, tuple[Mapping[str, Any], PodView | None]] = {}
        views: list[tuple[PodView, Mapping[str, Any]]] = []
        deleting: list[Mapping[str, Any]] = []
        for pod in pods:
            hit = known.get(id(pod))
            if hit is not None and hit[0] is pod:
                view = hit[1]
            else:
                view = select_one(pod, spec, namespace, self.view, owner)
            judged[id(pod)] = (pod, view)
            if view is not None:
                views.append((view, pod))
            elif (pod.get("metadata") or {}).get("deletionTimestamp"):
                deleting.append(pod)
        views.sort(key=lambda pair: pair[0].name)
        selection = Selection(
            signature,
            judged,
            tuple(v for v, _ in views),
            tuple(deleting),
            tuple(p for _, p in views),
            {v.name: i for i, (v, _) in enumerate(views)},
        )
        self._selections[owner] = selection
        return selection

    def _reselect(
        self,
        previous: Selection,
        changed: list[Mapping[str, Any]],
        spec: WeightUpdateSpec,
        namespace: str,
        owner: OwnerKey,
    ) -> Selection | None:
        """``previous`` with the new objects ``changed`` of pods it selected, each still
        selected, in place (same order); ``None`` when the selection itself changed (a pod
        joined, left or is being deleted): the caller selects anew."""
        views, objects = list(previous.views), list(previous.objects)
        judged = dict(previous.judged)
        for pod in changed:
            meta = pod.get("metadata") or {}
            at = previous.positions.get(str(meta.get("name", "")))
            if at is None:
                return None
            view = select_one(pod, spec, namespace, self.view, owner)
            if view is None or view.name != views[at].name:
                return None
            judged.pop(id(objects[at]), None)
            judged[id(pod)] = (pod, view)
            views[at], objects[at] = view, pod
        if len(judged) != len(previous.judged):
            return None  # one pod given twice: select anew
        return Selection(
            previous.signature,
            judged,
            tuple(views),
            previous.deleting,
            tuple(objects),
            previous.positions,
        )

    def queries(
        self,
        owner: OwnerKey,
        views: tuple[PodView, ...],
        spec: WeightUpdateSpec,
        retried_at: str | None,
    ) -> Mapping[str, Query]:
        """:func:`queries`, reused while ``views`` is the very tuple it was made from (no pod
        changed) and the spec's version, source and the retry mark are the same."""
        source = target_source(spec)
        signature = (spec.version, source, retried_at)
        last = self._asked.get(owner)
        if last is not None and last[0] is views and last[1] == signature:
            return last[2]
        asked = queries(views, owner, spec.version, source, retried_at)
        self._asked[owner] = (views, signature, asked)
        return asked

    def group(
        self, owner: OwnerKey, views: tuple[PodView, ...], group_by: str | None
    ) -> tuple[Unit, ...]:
        """:func:`group_units` of ``views``, reusing the last pass's units: all of them when
        ``views`` is the very tuple they were grouped from, else those of unchanged views.
        Without ``groupBy`` a unit is one pod, in the views' order: when the same pods are
        there, only the units of changed views are built again, in place."""
        last = self._units.get(owner)
        if last is not None and last[0] is views:
            return last[1]
        if group_by is None and last is not None and len(last[0]) == len(views):
            old, singles = last[0], list(last[1])
            for i, view in enumerate(views):
                if view is not old[i]:
                    if view.name != old[i].name:
                        break
                    singles[i] = Unit(view.unit, (view,))
            else:
                units = tuple(singles)
                self._units[owner] = (views, units, None)
                return units
        units = group_units(views, _units_by_key(last))
        self._units[owner] = (views, units, None)
        return units


def _units_by_key(last: _Grouped | None) -> dict[str, Unit] | None:
    if last is None:
        return None
    return last[2] if last[2] is not None else {u.key: u for u in last[1]}
