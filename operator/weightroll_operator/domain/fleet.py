"""Turn observed pod objects into :class:`PodView` values and group them into units.

Pure functions over plain dicts (the pod bodies from the kopf index or a list call).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightroll_operator.api.v1alpha1 import LabelSelector, SelectorOperator, WeightUpdateSpec
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    OwnerKey,
    PodView,
    WeightState,
)

__all__ = [
    "AGENT_PORT_NAME",
    "Unit",
    "agent_port_mismatch",
    "group_units",
    "matches",
    "pod_view",
    "select_one",
    "select_pods",
    "sort_views",
    "terminating_units",
    "trim_pod",
    "trim_weightupdate",
]

#: The one container port the operator calls (and sends a token to): no other port of a pod, and
#: no port a WeightUpdate names, is ever a target (no confused deputy; docs/architecture.md).
AGENT_PORT_NAME = "weightroll"


def matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND every matchExpression)."""
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    for req in selector.match_expressions:
        present = req.key in labels
        if req.operator is SelectorOperator.IN and labels.get(req.key) not in req.values:
            return False
        if req.operator is SelectorOperator.NOT_IN and present and labels[req.key] in req.values:
            return False
        if req.operator is SelectorOperator.EXISTS and not present:
            return False
        if req.operator is SelectorOperator.DOES_NOT_EXIST and present:
            return False
    return True


def _conditions(pod: Mapping[str, Any]) -> dict[str, bool]:
    return {
        str(c.get("type")): c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    }


@functools.lru_cache(maxsize=65536)
def _state(text: str) -> WeightState | None:
    # Pure and the result is frozen: the same annotation text is parsed once.
    return WeightState.from_json(text)


def _port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == AGENT_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def agent_port_mismatch(spec: WeightUpdateSpec, pods: Iterable[PodView]) -> str | None:
    """Why ``spec.agent.port`` (when set) does not name the ``weightroll`` port of every pod.

    Returns:
        ``None`` when it is unset or matches; otherwise a message naming the field.
    """
    want = spec.agent.port
    if want is None:
        return None
    for pod in pods:
        if pod.port != want:
            got = "none" if pod.port is None else str(pod.port)
            return (
                f"spec.agent.port: {want} is not the container port named {AGENT_PORT_NAME!r} "
                f"of Pod {pod.name} ({got}); the operator calls only that port (remove the field)"
            )
    return None


def pod_view(pod: Mapping[str, Any], *, group_by: str | None) -> PodView:
    """Build the view of one pod object."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = dict(meta.get("labels") or {})
    raw_state = annotations.get(ANNOTATION_WEIGHT_STATE)
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    restarts = ",".join(str(s.get("restartCount", 0)) for s in statuses)
    owner = annotations.get(ANNOTATION_OWNER)
    name = str(meta.get("name", ""))
    conditions = _conditions(pod)
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    ready = conditions.get("Ready") is True
    return PodView(
        name=name,
        namespace=str(meta.get("namespace", "")),
        unit=labels.get(group_by, name) if group_by else name,
        ready=ready,
        gate=conditions.get(CONDITION_WEIGHTS_READY),
        has_gate=CONDITION_WEIGHTS_READY in gates,
        owner=OwnerKey(owner) if owner else None,
        state=_state(raw_state) if raw_state else None,
        ip=(pod.get("status") or {}).get("podIP"),
        port=_port(pod),
        labels=labels,
        deleting=bool(meta.get("deletionTimestamp")),
        resource_version=meta.get("resourceVersion"),
        incarnation=f"{meta.get('uid', '')}|{(pod.get('status') or {}).get('podIP')}|{restarts}",
        containers_ready=conditions.get("ContainersReady"),
        ready_lags_gates=(
            not ready
            and conditions.get("ContainersReady") is True
            and all(conditions.get(str(t)) is True for t in gates)
        ),
        uid=meta.get("uid"),
    )


#: Signature of :func:`pod_view` (a caller may pass a caching wrapper to :func:`select_pods`).
ViewFn = Callable[[Mapping[str, Any], str | None], PodView]


def _view(pod: Mapping[str, Any], group_by: str | None) -> PodView:
    return pod_view(pod, group_by=group_by)


def select_pods(
    pods: Iterable[Mapping[str, Any]],
    spec: WeightUpdateSpec,
    namespace: str,
    view: ViewFn = _view,
    owner: OwnerKey | None = None,
) -> tuple[PodView, ...]:
    """Views of the pods in ``namespace`` matched by the spec's selector, or owned by ``owner``
    (the WeightUpdate), deleting pods left out.

    A pod being deleted never blocks a rollout (issue 4): it is simply not part of the fleet.
    A pod the WeightUpdate owns stays in it even when it stops matching: the claim removes the
    ``trafficLabel``, which a selector may name, and a relabelled pod is still drained. Left
    out, it would be drained with no one to finish it, and out of the budget and the metrics.
    """
    views = [
        v for v in (select_one(pod, spec, namespace, view, owner) for pod in pods) if v is not None
    ]
    return sort_views(views)


def select_one(
    pod: Mapping[str, Any],
    spec: WeightUpdateSpec,
    namespace: str,
    view: ViewFn = _view,
    owner: OwnerKey | None = None,
) -> PodView | None:
    """The view of ``pod`` when :func:`select_pods` selects it, else ``None``."""
    meta = pod.get("metadata") or {}
    if meta.get("namespace") != namespace or meta.get("deletionTimestamp"):
        return None
    if not matches(spec.selector, meta.get("labels") or {}):
        owned = owner is not None and (meta.get("annotations") or {}).get(ANNOTATION_OWNER) == owner
        if not owned:
            return None
    return view(pod, spec.group_by)


def terminating_units(
    pods: Iterable[Mapping[str, Any]],
    spec: WeightUpdateSpec,
    namespace: str,
    owner: OwnerKey | None = None,
) -> dict[str, str]:
    """The pods :func:`select_one` would select but for their deletion: unit key -> the
    latest ``deletionTimestamp`` of its pods (when the grace period ends).

    A pod being deleted is out of traffic until it is gone, and its replacement may not exist
    yet: the budget counts its unit as unavailable (issue 11, C), though it is not in the fleet.
    """
    keys: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        deleted = meta.get("deletionTimestamp")
        if not deleted or meta.get("namespace") != namespace:
            continue
        owned = owner is not None and (meta.get("annotations") or {}).get(ANNOTATION_OWNER) == owner
        if owned or matches(spec.selector, meta.get("labels") or {}):
            key = _view(pod, spec.group_by).unit
            keys[key] = max(keys.get(key, ""), str(deleted))
    return keys


def sort_views(views: Iterable[PodView]) -> tuple[PodView, ...]:
    """Views in :func:`select_pods` order (by pod name)."""
    return tuple(sorted(views, key=_name))


@dataclass(frozen=True, slots=True)
class Unit:
    """Pods updated and verified together (one pod, or one ``groupBy`` group)."""

    key: str
    pods: tuple[PodView, ...]
    #: Every pod is Ready. This and the two below are computed once: a pass reads them
    #: several times per unit, and a unit of unchanged pods is reused from pass to pass.
    ready: bool = field(init=False)
    #: Every pod has our readiness gate and it is not True: our gate holds the unit out.
    gated_out: bool = field(init=False)
    #: Some pod has our readiness gate and it is not True.
    partly_gated_out: bool = field(init=False)

    def __post_init__(self) -> None:
        pods = self.pods
        ready = pods[0].ready if len(pods) == 1 else all(p.ready for p in pods)
        object.__setattr__(self, "ready", ready)
        out = [p.has_gate and p.gate is not True for p in pods]
        object.__setattr__(self, "gated_out", all(out))
        object.__setattr__(self, "partly_gated_out", any(out))


def group_units(
    pods: Iterable[PodView], known: Mapping[str, Unit] | None = None
) -> tuple[Unit, ...]:
    """Group pod views by unit key, sorted by key (a stable rollout order).

    ``known`` (the units of an earlier call, by key) only saves work: a unit made of the very
    same view objects is reused instead of built again; the result is the same without it.
    """
    groups: dict[str, list[PodView]] = {}
    for pod in pods:
        same = groups.get(pod.unit)
        if same is None:
            groups[pod.unit] = [pod]
        else:
            same.append(pod)
    known = known or {}
    units = []
    for key in sorted(groups):
        members = groups[key]
        if len(members) > 1:
            members.sort(key=_name)
        unit = known.get(key)
        if unit is None or not _same_objects(unit.pods, members):
            unit = Unit(key, tuple(members))
        units.append(unit)
    return tuple(units)


def _same_objects(held: tuple[PodView, ...], members: list[PodView]) -> bool:
    if len(held) != len(members):
        return False
    return all(a is b for a, b in zip(held, members, strict=True))


_name: Callable[[PodView], str] = operator.attrgetter("name")


def trim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """Keep only the fields the operator reads (the pod index holds every pod of the cluster)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ports = [
        {"ports": [dict(p) for p in c.get("ports") or [] if p.get("name") == AGENT_PORT_NAME]}
        for c in spec.get("containers") or []
    ]
    return {
        "metadata": {
            k: meta[k]
            for k in (
                "name",
                "namespace",
                "uid",
                "labels",
                "annotations",
                "resourceVersion",
                "deletionTimestamp",
            )
            if k in meta
        },
        "spec": {"readinessGates": list(spec.get("readinessGates") or []), "containers": ports},
        "status": {
            "podIP": status.get("podIP"),
            "conditions": [dict(c) for c in status.get("conditions") or []],
            "containerStatuses": [
                {"restartCount": s.get("restartCount", 0)}
                for s in status.get("containerStatuses") or []
            ],
        },
    }


def trim_weightupdate(body: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata, spec and the status fields ownership decisions read."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    return {
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "creationTimestamp", "deletionTimestamp")
            if k in meta
        },
        "spec": dict(body.get("spec") or {}),
        "status": {
            k: status.get(k)
            for k in ("phase", "startTime", "completionTime", "targetVersion")
            if k in status
        },
    }
