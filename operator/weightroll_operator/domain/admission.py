"""Admission of pods no WeightUpdate governs: when the operator sets a fresh pod's gate True.

Only the operator writes the pod condition ``weightroll.io/weights-ready``. A pod is created
without it, so Kubernetes keeps a pod that lists the readiness gate NotReady until someone sets
it. A WeightUpdate sets it for the pods it selects (after a verified update, or for a pod already
serving its version); every other pod would never receive traffic, and the first WeightUpdate
would find the whole fleet unavailable and drain it at once, whatever ``maxUnavailable`` says.

:func:`decide` is the rule: the operator *admits* a pod, setting the gate True on the weights it
booted with, only when every one of these holds:

1. the pod lists ``weightroll.io/weights-ready`` in ``spec.readinessGates``;
2. the gate condition is absent (never set). ``False`` means a WeightUpdate drained the pod, and
   a drained pod is never re-enabled by admission (fail-closed rule 6);
3. the pod carries neither ``weightroll.io/owner`` nor ``weightroll.io/weight-state`` (no
   WeightUpdate ever touched it) and is not being deleted;
4. its ``ContainersReady`` condition is True: vLLM is up and the agent's ``/readyz`` answers 200,
   which the agent does only when every rank is clean at one version, nothing holds the replica
   and generation runs (the agent's half of fail-closed rule 1);
5. no WeightUpdate of the pod's namespace selects it, in any phase: a selected pod is governed by
   its WeightUpdate (a ``Succeeded`` one still updates new pods; a ``Failed`` or paused one
   decides when to touch them). A WeightUpdate whose spec does not parse selects nothing, as it
   drives nothing.

Invariants: pure, no I/O and no clock; the input mappings are never modified. Conditions are
checked cheapest first; the reason names the first one that fails.

Limitations: the rule sees the WeightUpdates the caller passes (the operator's index). A
WeightUpdate created in the instant between the decision and the write may find the pod admitted;
it then drains and updates it like any other pod it selects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightroll_operator.api.v1alpha1 import parse_spec
from weightroll_operator.domain.fleet import matches
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
)

__all__ = ["Admission", "AdmissionReason", "awaits_admission", "decide"]


class AdmissionReason:
    """Why a pod was or was not admitted (CamelCase, stable: tests and logs match on them)."""

    #: Every condition holds: the gate is set True (also the condition's ``reason``).
    ADMITTED = "Admitted"
    NO_READINESS_GATE = "NoReadinessGate"
    #: The gate is True already (admitted, or verified by a WeightUpdate).
    GATE_TRUE = "GateTrue"
    #: The gate is False: a WeightUpdate drained the pod; only a WeightUpdate re-enables it.
    GATE_FALSE = "GateFalse"
    DELETING = "Deleting"
    OWNED = "OwnedByWeightUpdate"
    #: The pod carries a ``weight-state``: a WeightUpdate has touched it.
    HAS_WEIGHT_STATE = "HasWeightState"
    CONTAINERS_NOT_READY = "ContainersNotReady"
    SELECTED = "SelectedByWeightUpdate"


@dataclass(frozen=True, slots=True)
class Admission:
    """The decision for one pod."""

    admit: bool
    #: An :class:`AdmissionReason` constant.
    reason: str
    #: A sentence for logs (Kubernetes message style: no final period).
    message: str


def _conditions(pod: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(c.get("type")): str(c.get("status"))
        for c in (pod.get("status") or {}).get("conditions") or []
    }


def _has_gate(pod: Mapping[str, Any]) -> bool:
    return any(
        g.get("conditionType") == CONDITION_WEIGHTS_READY
        for g in (pod.get("spec") or {}).get("readinessGates") or []
    )


def awaits_admission(pod: Mapping[str, Any]) -> bool:
    """Cheap prefilter of pod events: the pod lists our gate and the gate was never set.

    Every pod of the cluster passes through it on every change, so it checks only the two
    conditions that rule out almost every pod; :func:`decide` checks the rest.
    """
    return _has_gate(pod) and CONDITION_WEIGHTS_READY not in _conditions(pod)


def _selecting(pod: Mapping[str, Any], peers: Iterable[Mapping[str, Any]]) -> str | None:
    """Name of the first WeightUpdate of the pod's namespace whose valid spec selects the pod."""
    meta = pod.get("metadata") or {}
    namespace, labels = meta.get("namespace"), meta.get("labels") or {}
    for peer in peers:
        peer_meta = peer.get("metadata") or {}
        if peer_meta.get("namespace") != namespace:
            continue
        try:
            spec = parse_spec(peer.get("spec"))
        except ValueError:
            continue  # drives nothing, so governs nothing
        if matches(spec.selector, labels):
            return str(peer_meta.get("name"))
    return None


def decide(pod: Mapping[str, Any], peers: Iterable[Mapping[str, Any]]) -> Admission:
    """Whether the operator sets the gate of ``pod`` True on its boot weights.

    Args:
        pod: the pod object (a full body or :func:`~weightroll_operator.domain.fleet.trim_pod`).
        peers: WeightUpdate objects (full or trimmed); those of other namespaces are ignored.

    Returns:
        The decision; ``reason`` names the first condition (in the module docstring's order)
        that does not hold, or ``Admitted``.
    """
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    conditions = _conditions(pod)
    gate = conditions.get(CONDITION_WEIGHTS_READY)
    no = AdmissionReason
    if not _has_gate(pod):
        return Admission(False, no.NO_READINESS_GATE, "No readiness gate of ours")
    if gate == "True":
        return Admission(False, no.GATE_TRUE, "Gate already True")
    if gate is not None:
        return Admission(False, no.GATE_FALSE, f"Gate {gate}: drained by a WeightUpdate")
    if meta.get("deletionTimestamp"):
        return Admission(False, no.DELETING, "Being deleted")
    if ANNOTATION_OWNER in annotations:
        return Admission(False, no.OWNED, f"Owned by WeightUpdate {annotations[ANNOTATION_OWNER]}")
    if ANNOTATION_WEIGHT_STATE in annotations:
        return Admission(False, no.HAS_WEIGHT_STATE, "Touched by a WeightUpdate (weight-state)")
    if conditions.get("ContainersReady") != "True":
        return Admission(False, no.CONTAINERS_NOT_READY, "Containers not ready")
    selected_by = _selecting(pod, peers)
    if selected_by is not None:
        return Admission(False, no.SELECTED, f"Selected by WeightUpdate {selected_by}")
    return Admission(True, no.ADMITTED, "No WeightUpdate selects it")
