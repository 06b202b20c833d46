"""Errors of the engine agent, each with a stable machine-readable ``code``.

Every error raised inside a rank is turned into a :class:`engine_agent.protocol.ErrorBody` in the
rank's report (``code``, ``message`` and, where one input is at fault, ``field``), so the sidecar
and the operator can act on the code and a human can act on the message. Messages name the
offending tensor, shard or field and say what would fix it.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "CoverageIncomplete",
    "DerivedStateUnsupported",
    "DuplicateShard",
    "IdentityChanged",
    "InvalidRequest",
    "LoaderUnsupported",
    "ManifestMismatch",
    "PrefetchMemory",
    "ShapeMismatch",
    "SourceUnavailable",
    "SparseRefused",
    "UnknownTensor",
    "UpdateConflict",
    "WrongState",
]


class AgentError(Exception):
    """Base class: ``code`` is stable, ``field`` names the input at fault (if any)."""

    code = "internal"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(AgentError):
    """A call's argument does not validate (malformed JSON, unknown field, bad value)."""

    code = "invalid_request"


class WrongState(AgentError):
    """The call is not allowed in the engine's current state (e.g. load before begin)."""

    code = "wrong_state"


class UpdateConflict(AgentError):
    """Another update session is active on this engine."""

    code = "update_conflict"


class SourceUnavailable(AgentError):
    """A checkpoint file is missing, unreadable, truncated or not safetensors."""

    code = "source_unavailable"


class ManifestMismatch(AgentError):
    """Bytes read from the source differ from the manifest (digest, dtype or shape)."""

    code = "manifest_mismatch"


class UnknownTensor(AgentError):
    """A checkpoint tensor maps to no parameter of this model (or is outside the scope)."""

    code = "unknown_tensor"


class LoaderUnsupported(AgentError):
    """The model's loader writes a parameter in a way no shard can be accounted for (part of it,
    or in place, without its weight loader); refused, by the dry run before any write."""

    code = "loader_unsupported"


class ShapeMismatch(AgentError):
    """A checkpoint tensor's shape or dtype does not fit the parameter it maps to."""

    code = "shape_mismatch"


class DuplicateShard(AgentError):
    """A shard was sent twice in one session; the second write was refused."""

    code = "duplicate_shard"


class CoverageIncomplete(AgentError):
    """``finish`` found required shards that never arrived."""

    code = "coverage_incomplete"


class IdentityChanged(AgentError):
    """A kernel-visible tensor moved, changed layout, or a module changed kernel."""

    code = "identity_changed"


class SparseRefused(AgentError):
    """A sparse patch targets a module whose live layout is not the checkpoint layout."""

    code = "sparse_refused"


class DerivedStateUnsupported(AgentError):
    """A touched module has derived state that no registered refresher can rebuild."""

    code = "derived_state_unsupported"


class PrefetchMemory(AgentError):
    """A prefetch would stage more bytes than its limit or the host's available memory."""

    code = "prefetch_memory"
