"""Wire models shared by the worker extension, the pod sidecar and the operator.

This module is the one contract between the three processes that take part in an update:

* the **worker extension** (``engine_agent.vllm_extension``) runs inside every vLLM rank and is
  called through ``collective_rpc``; its methods take one JSON string and return a plain dict
  that validates as :class:`RankReport` or :class:`RankStatus`;
* the **sidecar** (``weightroll-agent``) serves the operator over HTTP with :class:`UpdateRequest`,
  :class:`UpdateStatus` and :class:`AgentState`;
* the **operator** imports nothing else from the agent side.

Parts: :mod:`.wire` (the base model and the string patterns), :mod:`.rank` (the worker
extension's calls, answers and method names) and :mod:`.agent_api` (the sidecar's HTTP API).
This package is the façade every other module imports; the names below are its public surface.

Invariants:
    * No torch or vLLM import here: the operator image has neither.
    * Every model forbids unknown fields, so a typo is a 422 naming the field rather than a
      silently ignored option.
    * JSON uses camelCase (Kubernetes style); Python attributes are snake_case and both spellings
      are accepted on input.
"""

from __future__ import annotations

from engine_agent.protocol.agent_api import (
    AgentState,
    DrainMode,
    DrainSpec,
    PrefetchMode,
    PrefetchSpec,
    SourceSpec,
    UpdatePhase,
    UpdateRequest,
    UpdateStatus,
    Verdict,
)
from engine_agent.protocol.rank import (
    AbortArgs,
    EngineState,
    ErrorBody,
    ExtensionRpc,
    LoadSource,
    PrefetchArgs,
    RankId,
    RankReport,
    RankStatus,
    UpdateMode,
    UpdateSpec,
)
from engine_agent.protocol.wire import (
    MANIFEST_DIGEST_PATTERN,
    STILL_TRUE_VIOLATED,
    UPDATE_ID_PATTERN,
    VERSION_PATTERN,
    WireModel,
)

__all__ = [
    "STILL_TRUE_VIOLATED",
    "MANIFEST_DIGEST_PATTERN",
    "VERSION_PATTERN",
    "UPDATE_ID_PATTERN",
    "AbortArgs",
    "AgentState",
    "DrainMode",
    "DrainSpec",
    "EngineState",
    "ErrorBody",
    "ExtensionRpc",
    "LoadSource",
    "PrefetchArgs",
    "PrefetchMode",
    "PrefetchSpec",
    "RankId",
    "RankReport",
    "RankStatus",
    "SourceSpec",
    "UpdateMode",
    "UpdatePhase",
    "UpdateRequest",
    "UpdateSpec",
    "UpdateStatus",
    "Verdict",
    "WireModel",
]
