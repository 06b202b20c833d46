"""TEST DOUBLE: a virtual clock and an in-memory Kubernetes API server for the simulation tier.

:class:`SimApiServer` implements the operator's ``KubePort`` (``weightroll_operator/ports.py``)
the way the real API server behaves for the calls the operator makes:

* one cluster-wide ``resourceVersion`` counter (etcd's revision): every accepted write to a pod
  bumps the pod to the next revision; a write conditional on another version than the pod's is
  refused with 409 (``KubeConflict``), a write to a pod that is gone with 404 (``KubeNotFound``);
* ``pods/status`` patches merge ``status.conditions`` by ``type`` (strategic merge); a write of
  our gate changes the gate only, never ``Ready`` (the kubelet writes that, late: below);
* a write never mutates a pod object: it replaces it (copy on write), as a watch delivers a new
  object per change (the reconciler reuses views of the very same object);
* WeightUpdate status patches are JSON merge patches (RFC 7386).

It also plays two things that are not the API server: **kubelet** (:meth:`kubelet_sync` writes
``ContainersReady``/``Ready`` from what the simulated containers say) and the operator's **pod
index** (:meth:`index`): every revision of the pod list is kept, and a pass may be handed an older
one than the server has (watch lag), never an older one than the last it saw (a watch does not go
back in time) except on a re-list. A re-list after the watch expired (410 Gone) is kopf's: every
listed pod is replayed, but a pod deleted while the watch was down stays in the index for good
(a **ghost**, :meth:`relist_after_410`) until a pod of its name is listed again; only a read of
the pod itself (:meth:`find_pod`, the operator's ``PodReader``) tells it is gone.

The kubelet acts on a gate write late, as the real one does (found on a real node): it learns of
the write through its watch (:meth:`kubelet_watch` takes its snapshot of each pod's conditions)
and, at its next pod sync, writes ``Ready`` by kubelet's rule (``tests.harness.kube_fleet.
kubelet_ready``: containers ready AND every readiness-gate condition True) from the conditions of
that snapshot, as a merge of ``ContainersReady``/``Ready`` only. A ``GateOn`` then a ``GateOff``
between two watch deliveries can so leave ``Ready`` False for a moment and then land ``Ready``
True from the gate True the kubelet saw, after the operator read the False as its drain.

Limitations: one namespace; no ``deletionTimestamp`` grace period (a deleted pod is gone at once);
no label selectors on lists; Events are counted, not kept.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY
from weightroll_operator.errors import KubeConflict, KubeNotFound, KubeUnavailable

from tests.harness.kube_fleet import kubelet_ready

__all__ = ["NAMESPACE", "AGENT_PORT", "GateWrite", "SimApiServer", "SimClock", "merge_patch"]

NAMESPACE = "sim"
AGENT_PORT = 8470
_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class SimClock:
    """Virtual time: ``now()`` for the reconciler and the agents, ``monotonic()`` for their
    timers, :meth:`sleep` for an agent's wait on a deadline. Only :meth:`step` moves it;
    nothing sleeps in real time."""

    seconds: float = 0.0
    #: (wake-up time, its waiter) of each :meth:`sleep` not ended yet.
    sleepers: list[tuple[float, asyncio.Future[None]]] = field(default_factory=list)

    def now(self) -> datetime:
        return _EPOCH + timedelta(seconds=self.seconds)

    def monotonic(self) -> float:
        return self.seconds

    def step(self, seconds: float) -> None:
        """Move time on; a sleep due by then ends (its waiter runs at the loop's next turn)."""
        self.seconds += seconds
        due = [(at, f) for at, f in self.sleepers if at <= self.seconds]
        self.sleepers = [(at, f) for at, f in self.sleepers if at > self.seconds]
        for _, waiter in due:
            if not waiter.done():
                waiter.set_result(None)

    async def sleep(self, seconds: float) -> None:
        """Wait until :meth:`step` has moved time ``seconds`` on."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleepers.append((self.seconds + seconds, waiter))
        await waiter


def merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386 JSON merge patch of ``target`` in place (null removes, objects merge)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


@dataclass(frozen=True)
class GateWrite:
    """One accepted write of our gate condition (what the invariants judge gate flips by)."""

    pod: str
    status: bool
    revision: int


def _conditions(pod: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: dict(c) for c in pod["status"]["conditions"]}


def _gates(pod: Mapping[str, Any]) -> list[str]:
    return [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]


def _copy(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A new pod object sharing nothing a write changes with the old one (the spec is shared:
    nothing writes it)."""
    meta, status = pod["metadata"], pod["status"]
    return {
        **pod,
        "metadata": {
            **meta,
            "labels": dict(meta["labels"]),
            "annotations": dict(meta["annotations"]),
        },
        "status": {
            **status,
            "conditions": [dict(c) for c in status["conditions"]],
            "containerStatuses": [dict(c) for c in status["containerStatuses"]],
        },
    }


@dataclass
class SimApiServer:
    """The in-memory API server (``KubePort``) plus kubelet and the pod index; see the module
    docstring."""

    clock: SimClock
    #: Current pod objects by name (never mutated; replaced on every write).
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: WeightUpdate objects by name (mutated in place: the operator is handed copies).
    weightupdates: dict[str, dict[str, Any]] = field(default_factory=dict)
    revision: int = 1
    #: The pod list at every revision (name -> object), oldest first: what a lagging index holds.
    history: list[tuple[int, dict[str, dict[str, Any]]]] = field(default_factory=list)
    #: Position in :attr:`history` of the operator's index (moves forward only, but on a re-list).
    index_at: int = 0
    #: Pods deleted while the watch was down, kept by kopf's index after the 410 re-list.
    ghosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: Counter[str] = field(default_factory=Counter)
    gate_writes: list[GateWrite] = field(default_factory=list)
    #: Pods whose next operator write fails with 5xx (an API server hiccup).
    unavailable_once: set[str] = field(default_factory=set)
    #: Writes the operator process may still make before it stops (it crashed, or lost the
    #: Lease and its fence stopped it); ``None``: no limit. Every later write fails unsent.
    writes_left: int | None = None
    #: Each pod's conditions as the kubelet's watch last delivered them (its next sync computes
    #: ``Ready`` from these, not from the pod as it is now): :meth:`kubelet_watch`.
    kubelet_seen: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: Called after every accepted write of our gate: (pod, status) (the invariants' oracle).
    on_gate_write: Callable[[str, bool], None] = lambda name, status: None

    def __post_init__(self) -> None:
        self._snapshot()

    # ------------------------------------------------------------------ the pod index

    def _snapshot(self) -> None:
        self.history.append((self.revision, dict(self.pods)))

    def _commit(self, name: str, pod: dict[str, Any] | None) -> None:
        self.revision += 1
        if pod is None:
            self.pods.pop(name, None)
        else:
            pod["metadata"]["resourceVersion"] = str(self.revision)
            self.pods[name] = pod
        self._snapshot()

    def index(self, advance: int | None = None) -> list[dict[str, Any]]:
        """The pods the operator's index holds, after it caught up ``advance`` revisions
        (``None``: all the way to the head)."""
        head = len(self.history) - 1
        if advance is None:
            self.index_at = head
        else:
            self.index_at = min(head, self.index_at + max(0, advance))
        listed = self.history[self.index_at][1]
        for name in [n for n in self.ghosts if n in listed]:
            del self.ghosts[name]  # a pod of that name replaced the entry
        return [*listed.values(), *self.ghosts.values()]

    def relist_after_410(self) -> None:
        """The pod watch expired (410 Gone) and kopf listed the pods again: the index is at the
        head, and every pod it held that was deleted meanwhile stays in it (kopf's indexes never
        drop an entry a listing lacks)."""
        held = self.history[self.index_at][1]
        self.index_at = len(self.history) - 1
        head = self.history[self.index_at][1]
        self.ghosts.update({n: pod for n, pod in held.items() if n not in head})

    def fresh_index(self) -> None:
        """A new operator process lists the pods into an empty index: no ghosts."""
        self.ghosts.clear()
        self.index(None)

    @property
    def index_revision(self) -> int:
        return self.history[self.index_at][0]

    # ------------------------------------------------------------------ what the cluster does

    def create_pod(
        self, name: str, uid: str, ip: str, labels: Mapping[str, str], *, admitted: bool
    ) -> None:
        """A pod created by its workload controller; ``admitted``: its gate was already set True
        (a fleet that was running before the operator's first WeightUpdate)."""
        conditions = [
            {"type": "ContainersReady", "status": "False"},
            {"type": "Ready", "status": "False"},
        ]
        if admitted:
            conditions.append({"type": CONDITION_WEIGHTS_READY, "status": "True"})
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "uid": uid,
                "labels": dict(labels),
                "annotations": {},
            },
            "spec": {
                "readinessGates": [{"conditionType": CONDITION_WEIGHTS_READY}],
                "containers": [
                    {"name": "vllm"},
                    {
                        "name": "agent",
                        "ports": [{"name": "weightroll", "containerPort": AGENT_PORT}],
                    },
                ],
            },
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": conditions,
                "containerStatuses": [
                    {"name": "vllm", "ready": False, "restartCount": 0},
                    {"name": "agent", "ready": False, "restartCount": 0},
                ],
            },
        }
        self._commit(name, pod)
        self.kubelet_seen[name] = _conditions(pod)  # the kubelet starts the pod it was given

    def delete_pod(self, name: str) -> None:
        self._commit(name, None)
        self.kubelet_seen.pop(name, None)

    def kubelet_watch(self, names: Iterable[str] | None = None) -> None:
        """The kubelet's watch delivers ``names`` (``None``: every pod) as they are now: its
        next sync of each computes ``Ready`` from these conditions."""
        for name in self.pods if names is None else names:
            if name in self.pods:
                self.kubelet_seen[name] = _conditions(self.pods[name])

    def relabel_pod(self, name: str, labels: Mapping[str, str | None]) -> None:
        """Someone else (a user, another controller) changes the pod's labels."""
        pod = _copy(self.pods[name])
        for key, value in labels.items():
            if value is None:
                pod["metadata"]["labels"].pop(key, None)
            else:
                pod["metadata"]["labels"][key] = value
        self._commit(name, pod)

    def foreign_write(self, name: str) -> None:
        """Another writer touches the pod (an annotation of its own): the operator's next write
        planned from an older view gets 409."""
        pod = _copy(self.pods[name])
        n = int(pod["metadata"]["annotations"].get("sim/touched", "0")) + 1
        pod["metadata"]["annotations"]["sim/touched"] = str(n)
        self._commit(name, pod)

    def kubelet_sync(self, name: str, containers_ready: bool, *, restarted: bool = False) -> None:
        """A pod sync of the kubelet: it reports the pod's containers (ready or not;
        ``restarted`` bumps the restart counts) and ``Ready`` by kubelet's rule over the
        conditions its watch last delivered (:attr:`kubelet_seen`), merged into the pod as it is
        now (our gate as written stays); written only when something changed."""
        current = self.pods[name]
        conds = _conditions(current)
        seen = self.kubelet_seen.get(name, conds)
        was = conds.get("ContainersReady", {}).get("status") == "True"
        ready = kubelet_ready(seen, _gates(current), containers_ready)
        now_ready = conds.get("Ready", {}).get("status") == "True"
        if was == containers_ready and ready == now_ready and not restarted:
            return
        pod = _copy(current)
        conds["ContainersReady"] = {"type": "ContainersReady", "status": str(containers_ready)}
        conds["Ready"] = {"type": "Ready", "status": str(ready)}
        pod["status"]["conditions"] = list(conds.values())
        for status in pod["status"]["containerStatuses"]:
            status["ready"] = containers_ready
            if restarted:
                status["restartCount"] += 1
        self._commit(name, pod)

    # ------------------------------------------------------------------ KubePort

    def _sent(self) -> None:
        """One write leaves the operator, unless its process has stopped (:attr:`writes_left`)."""
        if self.writes_left is not None:
            if self.writes_left <= 0:
                raise KubeUnavailable(0, "the operator process stopped (crash or fence)")
            self.writes_left -= 1

    def _writable(self, name: str, resource_version: str | None) -> dict[str, Any]:
        self._sent()
        if name in self.unavailable_once:
            self.unavailable_once.discard(name)
            self.writes["unavailable"] += 1
            raise KubeUnavailable(503, f"pod {name}: the API server is unavailable")
        current = self.pods.get(name)
        if current is None:
            self.writes["not-found"] += 1
            raise KubeNotFound(404, f"pods {name!r} not found")
        if resource_version is not None and resource_version != current["metadata"].get(
            "resourceVersion"
        ):
            self.writes["conflict"] += 1
            raise KubeConflict(409, f"pod {name}: the object has been modified")
        return _copy(current)

    async def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None:
        pod = self._writable(name, resource_version)
        self.writes["pod-status"] += 1
        conds = _conditions(pod)
        conds[condition["type"]] = {**conds.get(condition["type"], {}), **condition}
        pod["status"]["conditions"] = list(conds.values())
        self._commit(name, pod)
        if condition["type"] == CONDITION_WEIGHTS_READY:
            gate = condition["status"] == "True"
            self.gate_writes.append(GateWrite(name, gate, self.revision))
            self.on_gate_write(name, gate)
        return str(self.revision)

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> str | None:
        pod = self._writable(name, resource_version)
        self.writes["pod-metadata"] += 1
        meta = pod["metadata"]
        for key, values in (("annotations", annotations), ("labels", labels)):
            for k, v in (values or {}).items():
                if v is None:
                    meta[key].pop(k, None)
                else:
                    meta[key][k] = v
        self._commit(name, pod)
        return str(self.revision)

    async def patch_weightupdate_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> None:
        self._sent()
        body = self.weightupdates.get(name)
        if body is None:
            raise KubeNotFound(404, f"weightupdates {name!r} not found")
        self.writes["wu-status"] += 1
        merge_patch(body.setdefault("status", {}), patch)

    async def find_pod(self, namespace: str, name: str) -> Any:
        """The pod as the API server has it now (``None``: none of that name): a read, not the
        index (``PodReader``)."""
        pod = self.pods.get(name)
        return None if pod is None else copy.deepcopy(pod)

    async def list_weightupdates(self, namespace: str) -> list[Any]:
        """The WeightUpdates as they are now (a LIST never lags, unlike the index a pass is
        handed its peers from)."""
        return [copy.deepcopy(body) for body in self.weightupdates.values()]

    async def read_agent_token(self, namespace: str, name: str, key: str) -> str:
        raise KubeNotFound(404, f"secrets {name!r} not found")  # the simulation sends no token

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self._sent()
        self.writes["event"] += 1

    async def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self._sent()
        self.writes["event"] += 1

    # ------------------------------------------------------------------ reading

    def gate(self, name: str) -> bool | None:
        cond = _conditions(self.pods[name]).get(CONDITION_WEIGHTS_READY)
        return None if cond is None else cond.get("status") == "True"

    def ready(self, name: str) -> bool:
        return _conditions(self.pods[name]).get("Ready", {}).get("status") == "True"
