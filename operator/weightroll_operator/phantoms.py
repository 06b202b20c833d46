"""Pods the index still holds but the API server no longer has ("phantoms").

kopf's ``@kopf.index`` is fed by watch events only. After a watch expires (410 Gone) kopf lists
the resource again and replays every listed object, but it never drops an entry that the new
listing lacks: a pod deleted while the watch was down stays in the pod index for good. Its
agent no longer answers; its unit, if one was in flight, timed out, failed, halted the rollout
and, since its owner could never be released, held the WeightUpdate's deletion (issue 27 item 5).

So the index is not trusted for a pod's absence of answers: when a pod's agent does not answer,
the operator asks the API server whether that pod (by name **and** uid) still exists (a list
narrowed to its name: the chart's RBAC grants ``list``, not ``get``), at most once per ``ttl``
seconds per pod. A pod confirmed gone (none of that name, or another uid under the name: it
was deleted and created again) is a **tombstone**: left out of every pass and of every release,
as if a ``DELETED`` event had arrived. A new pod under the name (another uid) is seen as usual.
Nothing is concluded from an API error: the pod stays, and is asked about again later.

Limitations:
    * Only a port that can read a pod (:class:`~weightroll_operator.ports.PodReader`) confirms
      anything; with another (the in-memory benchmark) every indexed pod is taken as present.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from weightroll_operator.domain.model import PodView
from weightroll_operator.errors import KubeError
from weightroll_operator.ports import PodReader

__all__ = ["Phantoms"]

#: Tombstones kept at most (a pod's uid is never reused, so an old one only costs memory).
_LIMIT = 100_000


def _mark(uid: str, resource_version: str | None) -> str:
    """One index entry: its pod's uid and version (a phantom's entry never changes again; an
    emulator that reuses a uid for a pod created again still gives it another version)."""
    return f"{uid}@{resource_version or ''}"


class Phantoms:
    """The tombstones of indexed pods the API server confirmed gone."""

    def __init__(
        self,
        reader: PodReader | None,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader, self._ttl, self._clock = reader, ttl, clock
        #: The index entries confirmed gone (:func:`_mark`).
        self._gone: set[str] = set()
        #: (namespace, name, uid) -> when it may be asked about again.
        self._checked: dict[tuple[str, str, str], float] = {}

    def present(self, raw: Mapping[str, Any]) -> bool:
        """``raw`` (an indexed pod object) is not a tombstone."""
        if not self._gone:
            return True
        meta = raw.get("metadata") or {}
        uid = meta.get("uid")
        return uid is None or _mark(str(uid), meta.get("resourceVersion")) not in self._gone

    def live(self, pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``pods`` without the tombstones."""
        return [p for p in pods if self.present(p)]

    async def confirm_gone(self, unanswered: Iterable[PodView]) -> frozenset[str]:
        """Ask the API server about the pods whose agents did not answer; return the names of
        those confirmed gone (now tombstones)."""
        if self._reader is None:
            return frozenset()
        now = self._clock()
        gone: set[str] = set()
        for pod in unanswered:
            if pod.uid is None:
                continue
            key = (pod.namespace, pod.name, pod.uid)
            if self._checked.get(key, 0.0) > now:
                continue
            if len(self._checked) >= _LIMIT:
                self._checked.clear()
            self._checked[key] = now + self._ttl
            try:
                current = await self._reader.find_pod(pod.namespace, pod.name)
            except KubeError:
                continue  # no answer is no evidence: asked again after the TTL
            uid = ((current or {}).get("metadata") or {}).get("uid")
            if current is None or (uid is not None and str(uid) != pod.uid):
                if len(self._gone) >= _LIMIT:
                    self._gone.clear()
                self._gone.add(_mark(pod.uid, pod.resource_version))
                gone.add(pod.name)
        return frozenset(gone)
