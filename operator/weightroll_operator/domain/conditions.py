"""Status conditions of a WeightUpdate: constructors, lookup, set and remove (argo-rollouts style).

:func:`set_condition` reports whether anything changed and keeps ``lastTransitionTime`` when the
status did not flip, so an unchanged pass writes nothing. Reason constants double as Event reasons.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from weightroll_operator.api.v1alpha1 import Condition, ConditionStatus, ConditionType

__all__ = [
    "Reason",
    "get_condition",
    "new_condition",
    "remove_condition",
    "set_condition",
    "timestamp",
]


class Reason:
    """Condition and Event reasons (CamelCase, stable: alerts and tests match on them)."""

    ROLLOUT_PROGRESSING = "RolloutProgressing"
    ROLLOUT_COMPLETE = "RolloutComplete"
    ROLLOUT_PENDING = "RolloutPending"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    FAILURE_BUDGET_EXCEEDED = "FailureBudgetExceeded"
    #: A canary unit failed: the rollout halts whatever ``maxFailedReplicas`` tolerates.
    CANARY_FAILED = "CanaryFailed"
    #: ``weightroll abort NAME``: halted by a person.
    ABORTED_BY_USER = "AbortedByUser"
    #: ``weightroll retry NAME``: a halt was cleared and the failed pods are tried again.
    RETRIED = "Retried"
    #: A halt found on the pods only: a rollback from the version recorded on them while the
    #: status says nothing of it (``halts``).
    ROLLBACK_RECORDED = "RollbackRecorded"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    ALL_VERIFIED = "AllReplicasVerified"
    UNVERIFIED = "ReplicasUnverified"
    UNITS_FAILED = "UnitsFailed"
    NO_FAILURES = "NoFailures"
    PAUSED_BY_SPEC = "PausedBySpec"
    CANARY_COMPLETE = "CanaryComplete"
    NOT_PAUSED = "NotPaused"
    OWNED_BY_OTHER = "OwnedByOtherWeightUpdate"
    NOT_BLOCKED = "NotBlocked"
    INVALID_SPEC = "InvalidSpec"
    NO_PODS = "NoPodsSelected"
    # unit transitions (Events)
    UNIT_DRAINING = "UnitDraining"
    UNIT_VERIFIED = "UnitVerified"
    UNIT_FAILED = "UnitFailed"
    UNIT_ROLLING_BACK = "UnitRollingBack"
    UNIT_ROLLED_BACK = "UnitRolledBack"
    UNIT_ABORTED = "UnitAborted"
    UNIT_RESTORED = "UnitRestored"
    UNIT_WITHDRAWN = "UnitWithdrawn"
    UNIT_PREFETCHING = "UnitPrefetching"
    #: A prefetch ahead of the drain ended without a verdict (swap deadline, abort, the spec
    #: moved on): the pod is released, serving what it served, and wanted again.
    UNIT_PREFETCH_RELEASED = "UnitPrefetchReleased"
    #: Deletion: what was done to the pods the WeightUpdate touched.
    RELEASED = "Released"
    RELEASE_PENDING = "ReleasePending"
    LEFT_DRAINED = "LeftDrained"
    PHASE_CHANGED = "PhaseChanged"


def timestamp(now: datetime) -> str:
    """RFC 3339 UTC with seconds precision, as Kubernetes writes it."""
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def new_condition(
    ctype: ConditionType, status: bool | None, reason: str, message: str, now: datetime
) -> Condition:
    value = {
        True: ConditionStatus.TRUE,
        False: ConditionStatus.FALSE,
        None: ConditionStatus.UNKNOWN,
    }
    return Condition(
        type=ctype,
        status=value[status],
        reason=reason,
        message=message,
        last_transition_time=timestamp(now),
    )


def get_condition(conditions: Sequence[Condition], ctype: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == ctype), None)


def set_condition(conditions: Sequence[Condition], cond: Condition) -> tuple[list[Condition], bool]:
    """Return the list with ``cond`` set and whether it changed.

    ``lastTransitionTime`` is kept from the old condition when the status did not flip.
    """
    old = get_condition(conditions, cond.type)
    if old is not None:
        if (old.status, old.reason, old.message) == (cond.status, cond.reason, cond.message):
            return list(conditions), False
        if old.status == cond.status:
            cond = cond.model_copy(update={"last_transition_time": old.last_transition_time})
    result = [c for c in conditions if c.type != cond.type] + [cond]
    order = list(ConditionType)
    result.sort(key=lambda c: order.index(c.type))
    return result, True


def remove_condition(
    conditions: Sequence[Condition], ctype: ConditionType
) -> tuple[list[Condition], bool]:
    result = [c for c in conditions if c.type != ctype]
    return result, len(result) != len(conditions)
