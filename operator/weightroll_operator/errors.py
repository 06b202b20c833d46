"""Errors of the operator, classed by what the caller should do about them.

HTTP answers map to classes by status code (kopf's ``_cogs/clients/errors.py`` is the model):
Kubernetes API errors derive from :class:`KubeError`, agent errors from :class:`AgentError`.
Only ``handlers.py`` turns these into kopf's ``TemporaryError``/``PermanentError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AgentConflict",
    "AgentError",
    "AgentNotFound",
    "AgentRejected",
    "AgentUnauthorized",
    "AgentUnavailable",
    "InvalidSpec",
    "KubeConflict",
    "KubeError",
    "KubeNotFound",
    "KubeServerError",
    "KubeUnavailable",
    "VerificationFailed",
    "WeightrollError",
    "kube_error",
]


class WeightrollError(Exception):
    """Base of every operator error."""


class InvalidSpec(WeightrollError):
    """The spec failed validation; the message names the field. Not retried until it changes."""


class VerificationFailed(WeightrollError):
    """An agent's verdict was not Committed at the expected version."""


class KubeError(WeightrollError):
    """The Kubernetes API answered with an error status."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body


class KubeNotFound(KubeError):
    """404: the object is gone (a deleted pod is not an error for a rollout)."""


class KubeConflict(KubeError):
    """409: a stale resourceVersion or an existing name."""


class KubeServerError(KubeError):
    """5xx: retry later."""


class KubeUnavailable(KubeError):
    """No answer at all (connection refused, timeout)."""


def kube_error(status: int, message: str, body: Any = None) -> KubeError:
    """The :class:`KubeError` subclass for an HTTP status."""
    cls: type[KubeError] = KubeError
    if status == 404:
        cls = KubeNotFound
    elif status == 409:
        cls = KubeConflict
    elif status >= 500:
        cls = KubeServerError
    return cls(status, message, body)


class AgentError(WeightrollError):
    """A pod agent call failed."""

    def __init__(self, message: str, *, status: int | None = None, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


class AgentUnavailable(AgentError):
    """No answer, a timeout or a 5xx: the agent may come back."""


class AgentRejected(AgentError):
    """A 4xx: the request itself is wrong (``field`` names the offending field if known)."""


class AgentUnauthorized(AgentRejected):
    """401: no or wrong bearer token."""


class AgentNotFound(AgentRejected):
    """404: the agent does not know the update id."""


class AgentConflict(AgentRejected):
    """409: another update is active on the agent (``active_id`` names it when known)."""

    def __init__(self, message: str, *, active_id: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.active_id = active_id
