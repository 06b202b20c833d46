"""A kmock emulator that plays kubelet for a fleet of fake vLLM pods (operator contract tests).

kmock replaces lists on patch (no strategic merge) and has no kubelet. :class:`FleetEmulator`
adds just enough to test the drain contract faithfully:

* ``pods/status`` patches merge ``status.conditions`` by ``type`` (strategic merge, as the real
  API server does for this list);
* after each such patch the pod's ``Ready`` condition is recomputed like kubelet does: containers
  ready **and** every ``spec.readinessGates`` condition True;
* every ``pods/status`` write is logged with a snapshot of the pod's fake agent at that instant,
  so a test can prove that no pod was ever marked ready while its agent was unverified;
* a pod patch (``pods/status`` or metadata) that names a ``metadata.resourceVersion`` other than
  the pod's is refused with 409, and each accepted one bumps the pod's ``resourceVersion`` and
  returns it (only for pods created with one: kmock itself keeps none). This is the API server's
  optimistic concurrency for patches, which admission and every operator pod write rely on; it
  also covers kmock replaying every object as ``ADDED`` when a watch starts, right after kopf's
  listing (a real watch resumes from the list's version).

Everything else is kmock's (see operator.md §4 for what it does not emulate), except one
shortcut that changes no answer: see :class:`_CheapFilter`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import kmock
import yaml
from kmock._internal import dsl as kmock_dsl
from kmock._internal import rendering as kmock_rendering
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY

__all__ = [
    "FleetEmulator",
    "kubelet_ready",
    "StatusWrite",
    "fleet_emulator",
    "make_pod",
    "make_weightupdate",
    "write_kubeconfig",
]


def kubelet_ready(
    conditions: Mapping[str, Mapping[str, Any]], gates: Iterable[str], containers_ready: bool
) -> bool:
    """Kubelet's rule for a pod's ``Ready`` (KEP-580): its containers are ready **and** every
    condition named in ``spec.readinessGates`` is True (a missing one counts as False).

    ``conditions`` maps condition type to condition. The one copy of the rule for the test
    doubles (this emulator and the simulated cluster of ``tests/harness/sim``).
    """
    return containers_ready and all(
        (conditions.get(g) or {}).get("status") == "True" for g in gates
    )


@dataclass(frozen=True)
class StatusWrite:
    pod: str
    conditions: list[dict[str, Any]]
    agent: dict[str, Any] | None

    def gate(self) -> str | None:
        for cond in self.conditions:
            if cond.get("type") == CONDITION_WEIGHTS_READY:
                return str(cond.get("status"))
        return None


@attrs.frozen
class StaleResourceVersion(kmock.KubernetesError):  # type: ignore[misc]
    """409, as the API server answers a patch whose ``resourceVersion`` precondition failed."""

    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; please apply your changes to the latest version"


class _CheapFilter(kmock_dsl.Filter):  # type: ignore[misc]
    """kmock's ``Filter`` whose ``request in view`` asks its criteria about that request alone.

    kmock 0.8 serves each request by asking, reaction after reaction (a dozen fallbacks), whether
    the request is in the reaction's view, and answers by filtering every request logged so far:
    a test's cost grew with the square of its requests (90 % of a rollout contract test's CPU).
    A ``Filter`` holds the requests of its source that meet its criteria (its ``__iter__``), so
    "in the source and meets the criteria" is the same answer for one request.
    """

    __slots__ = ()

    def __contains__(self, item: object) -> bool:
        if isinstance(item, kmock_rendering.Request):
            return item in self._source and bool(self.criteria(item))
        return bool(super().__contains__(item))


class _CheapPriority(kmock_dsl.Priority):  # type: ignore[misc]
    """kmock's ``Priority``: a hint for ordering reactions that holds its source's requests."""

    __slots__ = ()

    def __contains__(self, item: object) -> bool:
        if isinstance(item, kmock_rendering.Request):
            return item in self._source
        return bool(super().__contains__(item))


_CHEAP = {kmock_dsl.Filter: _CheapFilter, kmock_dsl.Priority: _CheapPriority}


class FleetEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock + conditions merged by type + a kubelet that recomputes ``Ready``."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._cheap_payloads = 0
        self.status_writes: list[StatusWrite] = []
        self.agent_snapshot: Callable[[str], dict[str, Any] | None] = lambda pod: None
        #: Pods whose containers are not ready (kubelet would say so): Ready stays False.
        self.containers_not_ready: set[str] = set()

    def __contains__(self, item: object) -> bool:
        if isinstance(item, kmock_rendering.Request):  # the request being served is the newest
            return any(r is item for r in reversed(self._requests))
        return bool(super().__contains__(item))

    def _make_membership_cheap(self) -> None:
        """Swap the plain filters and priorities of the reactions added since the last request
        (kmock's, and any a test added) for :class:`_CheapFilter` / :class:`_CheapPriority`."""
        for payload in self._payloads[self._cheap_payloads :]:
            node = payload._source
            while isinstance(node, kmock_dsl.Chained):
                cheap = _CHEAP.get(type(node))
                if cheap is not None:
                    object.__setattr__(node, "__class__", cheap)  # same slots: a frozen attrs
                node = node._source
        self._cheap_payloads = len(self._payloads)

    async def _handle(self, request: Any) -> Any:
        self._make_membership_cheap()
        res = request.resource
        is_pod_patch = (
            res is not None
            and res.plural == "pods"
            and request.method == kmock.method.PATCH
            and request.name
        )
        if not is_pod_patch:
            return await super()._handle(request)
        key = (kmock.resource("", "v1", "pods"), request.namespace, request.name)
        before = self._current(key)
        version = ((before or {}).get("metadata") or {}).get("resourceVersion")
        wanted = ((request.data or {}).get("metadata") or {}).get("resourceVersion")
        if version is not None and wanted is not None and wanted != version:
            raise StaleResourceVersion()
        bumped = before is not None and version and isinstance(request.data, dict)
        if bumped:
            # Every accepted write bumps the version, and the response carries the new one; the
            # request as recorded keeps the body the client sent (restored below).
            meta = request.data.setdefault("metadata", {})
            meta["resourceVersion"] = str(int(version) + 1)
        try:
            if request.subresource != "status":
                return await super()._handle(request)
            response = await super()._handle(request)  # kmock replaces the conditions list...
        finally:
            if bumped:
                if wanted is None:
                    meta.pop("resourceVersion")
                    if not meta:
                        request.data.pop("metadata")
                else:
                    meta["resourceVersion"] = wanted
        if before is not None:  # ...so merge by type and play kubelet on the stored object
            merged = self._merged(before, request)
            obj = self.objects[key]
            obj.patch({"status": {"conditions": merged}})
            await self._buses[res].put({"type": "MODIFIED", "object": obj.raw})
        return response

    async def kubelet_update(self, name: str, *, ready: bool, restarted: bool = False) -> None:
        """Play kubelet for one pod: its containers became (not) ready; ``restarted`` bumps
        the restart count (a container restarted: vLLM booted again). Not a logged write."""
        if ready:
            self.containers_not_ready.discard(name)
        else:
            self.containers_not_ready.add(name)
        res = kmock.resource("", "v1", "pods")
        obj = self.objects[(res, "default", name)]
        raw = dict(obj.raw)
        conds = {c["type"]: dict(c) for c in (raw.get("status") or {}).get("conditions") or []}
        gates = [g["conditionType"] for g in (raw.get("spec") or {}).get("readinessGates") or []]
        all_ready = kubelet_ready(conds, gates, ready)
        conds["Ready"] = {"type": "Ready", "status": "True" if all_ready else "False"}
        statuses = [dict(c) for c in (raw.get("status") or {}).get("containerStatuses") or []]
        for c in statuses:
            c["ready"] = ready
            if restarted:
                c["restartCount"] = int(c.get("restartCount", 0)) + 1
        obj.patch({"status": {"conditions": list(conds.values()), "containerStatuses": statuses}})
        await self._buses[res].put({"type": "MODIFIED", "object": obj.raw})

    def _current(self, key: Any) -> dict[str, Any] | None:
        try:
            obj = self.objects[key]
        except KeyError:
            return None
        return None if obj.deleted else dict(obj.raw)

    def _merged(self, current: dict[str, Any], request: Any) -> list[dict[str, Any]]:
        patch = dict(request.data or {})
        new = list(((patch.get("status") or {}).get("conditions")) or [])
        conds = {c["type"]: dict(c) for c in (current.get("status") or {}).get("conditions") or []}
        for c in new:
            conds[c["type"]] = {**conds.get(c["type"], {}), **c}
        gates = [
            g["conditionType"] for g in (current.get("spec") or {}).get("readinessGates") or []
        ]
        ready = kubelet_ready(conds, gates, request.name not in self.containers_not_ready)
        conds["Ready"] = {"type": "Ready", "status": "True" if ready else "False"}
        self.status_writes.append(
            StatusWrite(pod=request.name, conditions=new, agent=self.agent_snapshot(request.name))
        )
        return list(conds.values())


@contextlib.asynccontextmanager
async def fleet_emulator() -> AsyncIterator[tuple[FleetEmulator, str]]:
    """A running emulator with the WeightUpdate CRD declared; yields it and its URL."""
    emulator = FleetEmulator()
    emulator.resources[f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"] = kmock.ResourceInfo(
        kind=api.KIND,
        singular=api.SINGULAR,
        namespaced=True,
        verbs={"list", "watch", "get", "patch", "create", "delete"},
        shortnames={api.SHORT_NAME},
        subresources={"status"},
    )
    verbs = {"list", "watch", "get", "patch", "create", "delete"}
    emulator.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", singular="pod", namespaced=True, verbs=verbs, subresources={"status"}
    )
    for plural, kind in (("secrets", "Secret"), ("events", "Event")):
        emulator.resources[f"v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=True, verbs=verbs
        )
    # kopf waits for these two to be discoverable before it starts any watcher.
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs=verbs
    )
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        singular="customresourcedefinition",
        namespaced=False,
        verbs=verbs,
    )
    async with emulator, kmock.Server(emulator) as server:
        yield emulator, str(server.url).rstrip("/")


def make_pod(
    name: str,
    ip: str,
    port: int,
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    gate: bool | None = True,
) -> dict[str, Any]:
    """A running vLLM pod with our readiness gate, Ready as kubelet would compute it."""
    conditions = [{"type": "Ready", "status": "True" if gate else "False"}]
    if gate is not None:
        conditions.append({"type": CONDITION_WEIGHTS_READY, "status": "True" if gate else "False"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels or {"app": "llm"},
            "annotations": {},
        },
        "spec": {
            "readinessGates": [{"conditionType": CONDITION_WEIGHTS_READY}],
            "containers": [
                {
                    "name": "vllm",
                    "ports": [{"name": "weightroll", "containerPort": port}],
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": conditions,
            "containerStatuses": [{"name": "vllm", "ready": True, "restartCount": 0}],
        },
    }


def make_weightupdate(
    name: str,
    version: str,
    *,
    namespace: str = "default",
    strategy: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llm"}},
        "version": version,
        "source": {"uri": f"/weights/{version}"},
        "strategy": strategy or {},
    }
    body.update(spec)
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        # kmock keeps no resourceVersion; kopf JSON-patches finalizers with a "test" on it
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": body,
    }


def write_kubeconfig(directory: Path, url: str) -> Path:
    """A kubeconfig for the emulator at ``url`` (token ``t``), as the CLI commands load it."""
    path = directory / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                "users": [{"name": "me", "user": {"token": "t"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "me"}}],
                "current-context": "kmock",
            }
        )
    )
    return path
