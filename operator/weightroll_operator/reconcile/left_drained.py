"""The drained series of pods a deleted WeightUpdate left drained, until they serve again.

A WeightUpdate deleted while some of its pods could not go back into traffic leaves them
drained (``domain/release.py``); their drained series (``WeightrollReplicaLeftDrained``) outlives
the WeightUpdate, per namespace, until the pod's gate is True again or the pod is gone. The
pod's own record (its ``weight-state`` by ``<owner>~deleted``) survives a restart of the
operator, so :meth:`LeftDrained.note` rebuilds the series from every pod event.

This is state of the operator process across WeightUpdates (it outlives the one that was
deleted), which is why it is its own collaborator rather than part of one pass's report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightroll_operator.domain.fleet import pod_view
from weightroll_operator.domain.model import ANNOTATION_WEIGHT_STATE, CONDITION_WEIGHTS_READY
from weightroll_operator.domain.plan import parse_time
from weightroll_operator.domain.release import DELETED_SUFFIX
from weightroll_operator.metrics import Metrics

__all__ = ["LeftDrained"]


@dataclass
class LeftDrained:
    """Pods left drained by deleted WeightUpdates, and their exported series."""

    metrics: Metrics | None = None
    #: namespace -> pod -> (deleted WeightUpdate that left it drained, drained since): its
    #: drained series is kept until the pod serves again.
    _pods: dict[str, dict[str, tuple[str, float]]] = field(default_factory=dict)

    def track(self, namespace: str, name: str, pods: Mapping[str, float]) -> None:
        """The WeightUpdate ``name`` was deleted leaving ``pods`` drained (since when)."""
        if pods:
            here = self._pods.setdefault(namespace, {})
            here.update({pod: (name, since) for pod, since in pods.items()})

    def left_by(self, namespace: str, name: str) -> dict[str, float]:
        """Every pod the WeightUpdate ``name`` left drained, and since when."""
        return {
            pod: since for pod, (by, since) in self._pods.get(namespace, {}).items() if by == name
        }

    def note(self, pod: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Track ``pod`` if a deleted WeightUpdate left it drained (its ``weight-state`` is by
        ``<owner>~deleted`` and its gate is False), exporting its drained series.

        Called for every pod event, the initial listing included: the series of pods left
        drained lived only in this process, so a restarted operator (an upgrade, a failover to
        the standby) lost them and ``WeightrollReplicaLeftDrained`` resolved while the capacity
        stayed lost. The pod's own record survives; this rebuilds the series from it. A pod
        that is ``deleted`` (its DELETED event) loses its series.
        """
        meta = pod.get("metadata") or {}
        if deleted:
            namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
            left = self._pods.get(namespace, {})
            entry = left.pop(name, None)
            if entry is not None and self.metrics is not None:
                self.metrics.restored(namespace, entry[0], [name])
            if not left:
                self._pods.pop(namespace, None)
            return
        raw = (meta.get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE)
        if not raw or DELETED_SUFFIX not in raw:  # most pods: no parse
            return
        view = pod_view(pod, group_by=None)
        st = view.state
        if st is None or not st.by.endswith(DELETED_SUFFIX) or view.gate is not False:
            return
        if view.deleting or view.name in self._pods.get(view.namespace, {}):
            return
        gone = st.by.removesuffix(DELETED_SUFFIX).rpartition("/")[2]
        started = parse_time(st.started_at)
        since = started.timestamp() if started is not None else time.time()
        self.track(view.namespace, gone, {view.name: since})
        if self.metrics is not None:
            self.metrics.left_drained(view.namespace, gone, {view.name: since})

    def sweep(self, namespace: str, pods: Iterable[Mapping[str, Any]]) -> None:
        """Drop the drained series of pods a deleted WeightUpdate left drained, once they are
        back in traffic (gate True) or gone."""
        left = self._pods.get(namespace)
        if not left:
            return
        serving: set[str] = set()
        present: set[str] = set()
        for raw in pods:
            pname = str((raw.get("metadata") or {}).get("name"))
            if pname not in left:
                continue
            present.add(pname)
            for c in (raw.get("status") or {}).get("conditions") or []:
                if c.get("type") == CONDITION_WEIGHTS_READY and c.get("status") == "True":
                    serving.add(pname)
        done = [p for p in left if p in serving or p not in present]
        for pname in done:
            gone_name, _ = left.pop(pname)
            if self.metrics is not None:
                self.metrics.restored(namespace, gone_name, [pname])
        if not left:
            self._pods.pop(namespace, None)
