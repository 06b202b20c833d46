"""The agent token Secret as the WeightUpdate's status sees it (issue 11 finding 9).

A WeightUpdate naming ``spec.agent.tokenSecretRef`` needs that Secret and key to talk to its
agents. When the Secret is missing, has no such key, or the operator may not read it (RBAC
``rbac.agentTokenSecretNames``), the pass does nothing (no agent can be asked, so no unit may
move) and says why in three places: the condition ``AgentTokenAvailable=False`` with a reason
below, the gauge ``weightroll_agent_token_unavailable{reason}`` (alert
WeightrollAgentTokenUnavailable) and the status message. The condition is removed, and the gauge
cleared, on the first pass that reads the token again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from weightroll_operator.api.v1alpha1 import ConditionType, SecretKeyRef, WeightUpdateStatus
from weightroll_operator.domain.conditions import new_condition, remove_condition, set_condition
from weightroll_operator.errors import KubeError

__all__ = ["TokenProblem", "token_problem", "with_token_condition"]

#: Reasons of ``AgentTokenAvailable=False`` (and the metric's ``reason`` label).
SECRET_NOT_FOUND = "SecretNotFound"
SECRET_KEY_MISSING = "SecretKeyMissing"
SECRET_FORBIDDEN = "SecretForbidden"


@dataclass(frozen=True, slots=True)
class TokenProblem:
    reason: str
    message: str


def token_problem(error: KubeError, namespace: str, ref: SecretKeyRef) -> TokenProblem | None:
    """What a failed read of the token Secret means; ``None`` for a transient error (retried)."""
    where = f"Secret {namespace}/{ref.name}"
    if error.status == 404 and "has no key" in str(error):
        return TokenProblem(
            SECRET_KEY_MISSING, f"spec.agent.tokenSecretRef: {where} has no key {ref.key!r}"
        )
    if error.status == 404:
        return TokenProblem(SECRET_NOT_FOUND, f"spec.agent.tokenSecretRef: {where} not found")
    if error.status in (401, 403):
        return TokenProblem(
            SECRET_FORBIDDEN,
            f"spec.agent.tokenSecretRef: the operator may not read {where} (RBAC: the chart's "
            "rbac.agentTokenSecretNames)",
        )
    return None


def with_token_condition(
    status: WeightUpdateStatus, problem: TokenProblem | None, now: datetime
) -> WeightUpdateStatus:
    """``status`` with ``AgentTokenAvailable=False`` set for ``problem``, or removed."""
    if problem is None:
        conds, changed = remove_condition(status.conditions, ConditionType.AGENT_TOKEN_AVAILABLE)
        return status.model_copy(update={"conditions": conds}) if changed else status
    cond = new_condition(
        ConditionType.AGENT_TOKEN_AVAILABLE, False, problem.reason, problem.message, now
    )
    conds, _ = set_condition(status.conditions, cond)
    message = f"Blocked: {problem.message}"[:1000]
    return status.model_copy(update={"conditions": conds, "message": message})
