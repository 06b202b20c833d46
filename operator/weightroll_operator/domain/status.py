"""Compute the WeightUpdate status from a plan: counts, conditions, then phase (house rule 7).

Everything here is pure. :func:`status_patch` returns ``None`` when nothing but timestamps of
unchanged conditions would change, so an idle pass writes nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from weightroll_operator.api.v1alpha1 import (
    Condition,
    ConditionType,
    Phase,
    PodResult,
    ReplicaCounts,
    WeightUpdateSpec,
    WeightUpdateStatus,
)
from weightroll_operator.domain.actions import GateOn
from weightroll_operator.domain.conditions import (
    Reason,
    new_condition,
    remove_condition,
    set_condition,
)
from weightroll_operator.domain.model import OwnerKey, UnitState, WeightState
from weightroll_operator.domain.plan import WANTING_CLASSES, Plan, PodClass

__all__ = [
    "MAX_POD_RESULTS",
    "build_status",
    "compute_counts",
    "compute_phase",
    "invalid_status",
    "status_patch",
]

#: Bound of ``status.pods`` (failed pods are always listed, even past it).
MAX_POD_RESULTS = 50

_STATE_OF = {
    PodClass.UPDATED: "Verified",
    PodClass.PENDING: "Pending",
    PodClass.IN_FLIGHT: "Updating",
    PodClass.PREFETCHING: "Prefetching",
    PodClass.FAILED: "Failed",
    PodClass.ROLLED_BACK: "RolledBack",
    PodClass.ROLLBACK_FAILED: "Failed",
    PodClass.BLOCKED: "Blocked",
    PodClass.FOREIGN: "Superseded",
    PodClass.UNKNOWN: "Unknown",
}


def compute_counts(plan: Plan, spec: WeightUpdateSpec) -> ReplicaCounts:
    """Pods by state. ``stale``: not at the version and not being worked on right now.

    After a halt with ``onFailure: Rollback`` the rollout's aim is the previous version again:
    pods it never touched already serve it, so they are not stale (the fleet is uniform, and
    ``WeightrollFleetStale`` must not fire next to ``WeightrollUpdateFailed`` for the same
    rollback).
    """
    classes = list(plan.classes.values())
    aborted = plan.persisted.aborted_at is not None
    rolling_back = plan.rolling_back  # the planner's rule (``halts.rolls_back``)
    held = aborted or plan.paused_reason is not None or bool(plan.blocked_by)
    stale_classes = {PodClass.FOREIGN, PodClass.UNKNOWN, PodClass.BLOCKED}
    if held and not rolling_back:
        stale_classes.add(PodClass.PENDING)
    restored = _restored(plan)
    verified = sum(
        1
        for name, c in plan.classes.items()
        if c is PodClass.UPDATED and (plan.pods[name].gate is True or name in restored)
    )
    return ReplicaCounts(
        total=len(classes),
        updated=classes.count(PodClass.UPDATED),
        verified=verified,
        draining=classes.count(PodClass.IN_FLIGHT),
        failed=classes.count(PodClass.FAILED) + classes.count(PodClass.ROLLBACK_FAILED),
        stale=sum(1 for c in classes if c in stale_classes),
    )


def _restored(plan: Plan) -> frozenset[str]:
    """Pods whose traffic this pass restores (one scan of the actions, not one per pod)."""
    return frozenset(a.pod.name for a in plan.actions if isinstance(a, GateOn))


def compute_phase(plan: Plan, spec: WeightUpdateSpec) -> Phase:
    """The one-word phase, from the plan summary and the persisted intents."""
    flying = plan.in_flight_units > 0
    if plan.rolling_back:
        return Phase.ROLLING_BACK if flying or plan.rollback_remaining else Phase.ROLLED_BACK
    if plan.persisted.aborted_at is not None:
        return Phase.FAILED
    if plan.units_total == 0:
        return Phase.PENDING
    # A finished rollout is Succeeded again once no pod wants the version: a pod that joined
    # or restarted since and whose agent cannot be asked is not known to serve it
    wanting = any(c in WANTING_CLASSES for c in plan.classes.values())
    if plan.completed and not flying and not wanting:
        return Phase.SUCCEEDED
    if plan.paused_reason is not None and not flying:
        return Phase.PAUSED
    if not flying and plan.persisted.start_time is None:
        return Phase.PENDING
    return Phase.PROGRESSING


def _conditions(
    old: list[Condition],
    plan: Plan,
    spec: WeightUpdateSpec,
    phase: Phase,
    counts: ReplicaCounts,
    now: datetime,
) -> list[Condition]:
    conds, _ = remove_condition(old, ConditionType.INVALID_SPEC)
    p = plan.persisted
    prog: tuple[bool | None, str, str]
    if phase is Phase.ROLLED_BACK:
        prog = (False, Reason.ROLLED_BACK, f"Rolled back after {p.abort_reason}")
    elif phase is Phase.ROLLING_BACK:
        prog = (True, Reason.ROLLING_BACK, f"Rolling back after {p.abort_reason}")
    elif p.aborted_at is not None:
        prog = (False, p.abort_reason or "Halted", f"Halted at {p.aborted_at}")
    elif phase is Phase.SUCCEEDED:
        done = f"All selected pods serve {spec.version}"
        if counts.failed:  # tolerated (maxFailedReplicas), or stragglers after completion
            done = f"Rollout complete at {spec.version}; {counts.failed} failed pods (Degraded)"
        prog = (True, Reason.ROLLOUT_COMPLETE, done)
    elif phase is Phase.PAUSED:
        prog = (None, plan.paused_reason or Reason.PAUSED_BY_SPEC, "Paused")
    elif phase is Phase.PENDING:
        reason = Reason.NO_PODS if plan.units_total == 0 else Reason.ROLLOUT_PENDING
        prog = (None, reason, "No pods selected" if plan.units_total == 0 else "Not started")
    else:
        prog = (True, Reason.ROLLOUT_PROGRESSING, f"{plan.in_flight_units} units in flight")
    updates = [
        new_condition(ConditionType.PROGRESSING, prog[0], prog[1], prog[2], now),
        new_condition(
            ConditionType.VERIFIED,
            counts.total > 0 and counts.verified == counts.total,
            Reason.ALL_VERIFIED
            if counts.total > 0 and counts.verified == counts.total
            else Reason.UNVERIFIED,
            f"{counts.verified}/{counts.total} pods verified at {spec.version}",
            now,
        ),
        new_condition(
            ConditionType.DEGRADED,
            counts.failed > 0,
            Reason.UNITS_FAILED if counts.failed else Reason.NO_FAILURES,
            "; ".join(f"{k}: {v}" for k, v in sorted(plan.reasons.items()))[:1000],
            now,
        ),
        new_condition(
            ConditionType.PAUSED,
            plan.paused_reason is not None,
            plan.paused_reason or Reason.NOT_PAUSED,
            "Set spec.strategy.pauseAfterCanary to false to promote"
            if plan.paused_reason == Reason.CANARY_COMPLETE
            else "",
            now,
        ),
        new_condition(
            ConditionType.BLOCKED,
            bool(plan.blocked_by),
            Reason.OWNED_BY_OTHER if plan.blocked_by else Reason.NOT_BLOCKED,
            f"Pods are driven by WeightUpdate {', '.join(plan.blocked_by)}"
            if plan.blocked_by
            else "",
            now,
        ),
    ]
    for cond in updates:
        conds, _ = set_condition(conds, cond)
    return conds


#: The order of ``status.pods``: failures first (always all of them), then by how much a reader
#: needs to see the pod, each class by pod name.
_RESULT_ORDER = (
    PodClass.FAILED,
    PodClass.ROLLBACK_FAILED,
    PodClass.IN_FLIGHT,
    PodClass.PREFETCHING,
    PodClass.BLOCKED,
    PodClass.UNKNOWN,
    PodClass.PENDING,
    PodClass.FOREIGN,
    PodClass.ROLLED_BACK,
    PodClass.UPDATED,
)
_ALWAYS_LISTED = frozenset({PodClass.FAILED, PodClass.ROLLBACK_FAILED})


def _listed(classes: Mapping[str, PodClass]) -> list[tuple[str, PodClass]]:
    """Every failed pod, then the others in :data:`_RESULT_ORDER` up to ``MAX_POD_RESULTS`` in
    all (only the names shown are sorted: at 10,000 pods a full sort cost more than the rest of
    the status)."""
    by_class: dict[PodClass, list[str]] = {}
    for name, cls in classes.items():
        by_class.setdefault(cls, []).append(name)
    listed: list[tuple[str, PodClass]] = []
    for cls in _RESULT_ORDER:
        names = by_class.get(cls)
        if not names:
            continue
        room = MAX_POD_RESULTS - len(listed)
        if cls in _ALWAYS_LISTED:
            chosen = sorted(names)
        elif room <= 0:
            break
        else:
            chosen = heapq.nsmallest(room, names)
        listed.extend((name, cls) for name in chosen)
    return listed


def _listed_version(cls: PodClass, recorded: str | None, version: str) -> str | None:
    """The version a listed state is about: the pod's weight-state's, but a pod listed
    ``Verified`` is verified at ``spec.version`` whatever its record was about. A record at
    another version is history there (a failed or withdrawn attempt at a version the spec no
    longer names, spec.version reverted since): listing it made the status say ``Verified`` at
    a version the pod does not serve (found by the simulation tier)."""
    if cls is PodClass.UPDATED and recorded is not None:
        return version
    return recorded


def _pod_results(plan: Plan, extra: Mapping[str, str], version: str) -> list[PodResult]:
    results: list[PodResult] = []
    for name, cls in _listed(plan.classes):
        pod = plan.pods[name]
        recorded = pod.state.version if pod.state is not None else None
        results.append(
            PodResult(
                name=name,
                state=_STATE_OF[cls],
                version=_listed_version(cls, recorded, version),
                reason=(plan.reasons.get(name) or extra.get(name) or plan.notes.get(name) or None),
                unit=pod.unit if pod.unit != name else None,
                step=plan.steps.get(name),
            )
        )
    return results


def _message(phase: Phase, counts: ReplicaCounts, spec: WeightUpdateSpec, plan: Plan) -> str:
    parts = [f"{phase.value}: {counts.verified}/{counts.total} pods verified at {spec.version}"]
    if counts.draining:
        parts.append(f"{counts.draining} updating")
    if counts.failed:
        parts.append(f"{counts.failed} failed")
    if counts.stale:
        parts.append(f"{counts.stale} stale")
    if plan.blocked_by:
        parts.append(f"blocked by {', '.join(plan.blocked_by)}")
    if plan.persisted.abort_reason:
        parts.append(f"halted: {plan.persisted.abort_reason}")
    return "; ".join(parts)


def _served_before(state: WeightState | None, owner: OwnerKey | None) -> str | None:
    """What a pod served before ``owner`` drained it: the ``previous_version`` its own state
    records, or, for a pod it has not claimed yet, the version another WeightUpdate verified
    (or rolled back to) there; ``None`` when unknown (boot weights, a pod mid-update)."""
    if state is None:
        return None
    if owner is None or state.by == owner:
        return state.previous_version
    if state.state in (UnitState.VERIFIED, UnitState.ROLLED_BACK):
        return state.version
    return None


def build_status(
    plan: Plan,
    spec: WeightUpdateSpec,
    old: WeightUpdateStatus | None,
    generation: int | None,
    now: datetime,
    notes: Mapping[str, str] | None = None,
    owner: OwnerKey | None = None,
) -> WeightUpdateStatus:
    """The new status: counts, conditions, phase, ``observedGeneration``, persisted intents.

    ``owner`` is this WeightUpdate (``None``: every pod state is taken as its own); the
    ``stableVersion`` of a new rollout is what its pods served before it, which for a pod it
    has not claimed yet is the verdict another WeightUpdate left there.

    ``notes`` are per-pod reasons seen while applying the plan (e.g. an agent refusing the
    update); they show in ``status.pods`` until the pod's state explains itself.
    """
    counts = compute_counts(plan, spec)
    phase = compute_phase(plan, spec)
    old_conds = list(old.conditions) if old is not None else []
    p = plan.persisted
    stable = old.stable_version if old is not None and old.target_version == spec.version else None
    if stable is None:
        served = {_served_before(pod.state, owner) for pod in plan.pods.values()} - {None}
        stable = served.pop() if len(served) == 1 else None
    if phase is Phase.SUCCEEDED:
        stable = spec.version
    return WeightUpdateStatus(
        phase=phase,
        observed_generation=generation,
        target_version=spec.version,
        replicas=counts,
        stable_version=stable,
        conditions=_conditions(old_conds, plan, spec, phase, counts, now),
        pods=_pod_results(plan, notes or {}, spec.version),
        start_time=p.start_time,
        # kept once set: it marks the version as rolled out (convergence, superseded pods)
        completion_time=p.completion_time,
        last_progress_time=p.last_progress_time,
        aborted_at=p.aborted_at,
        abort_reason=p.abort_reason,
        retried_at=p.retried_at,
        message=_message(phase, counts, spec, plan),
    )


def invalid_status(
    old: WeightUpdateStatus | None, message: str, generation: int | None, now: datetime
) -> WeightUpdateStatus:
    """The status of a WeightUpdate whose spec failed validation: phase Failed, InvalidSpec."""
    conds = list(old.conditions) if old is not None else []
    conds, _ = set_condition(
        conds, new_condition(ConditionType.INVALID_SPEC, True, Reason.INVALID_SPEC, message, now)
    )
    base = old if old is not None else WeightUpdateStatus()
    return base.model_copy(
        update={
            "phase": Phase.FAILED,
            "observed_generation": generation,
            "conditions": conds,
            "message": f"Invalid spec: {message}"[:1000],
        }
    )


def status_patch(old: dict[str, Any] | None, new: WeightUpdateStatus) -> dict[str, Any] | None:
    """A JSON merge patch turning ``old`` into ``new``; ``None`` when they are equal.

    Keys present in ``old`` but not in ``new`` are set to null (merge-patch removal).
    """
    target = new.to_json_dict()
    current = dict(old or {})
    if current == target:
        return None
    # Only the keys that changed: a concurrent status patch of another key (``weightroll
    # abort``/``retry`` set abortedAt/retriedAt) is not overwritten with what this pass read.
    patch: dict[str, Any] = {k: v for k, v in target.items() if current.get(k) != v}
    for key in current:
        if key not in target:
            patch[key] = None
    return patch
