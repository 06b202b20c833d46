"""The ``WeightUpdate`` resource (``weightroll.io/v1alpha1``): the one typed source of truth.

``crds/weightupdates.weightroll.io.yaml`` is generated from these models by
:mod:`weightroll_operator.api.crdgen`; a test fails when they drift.

Invariants:
    * Every model forbids unknown fields, so a typo in a spec is an error naming the field.
    * JSON is camelCase (Kubernetes style); attributes are snake_case; both parse.
    * Validation messages name the field by its JSON path (``spec.strategy.maxUnavailable``), so
      the same text reads well in an ``InvalidSpec`` condition and in a CLI error.

Limitations:
    * The CRD schema cannot express every rule here (sparse needs ``baseVersion``, percentages
      bounded to 100 %); the operator re-validates every spec with these models and reports what
      the API server let through as an ``InvalidSpec`` condition.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from engine_agent.protocol import VERSION_PATTERN

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "SINGULAR",
    "VERSION",
    "AgentSpec",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "DrainMode",
    "DrainSpec",
    "LabelSelector",
    "LabelSelectorRequirement",
    "OnFailure",
    "Phase",
    "PodResult",
    "ReplicaCounts",
    "LOCAL_URI_PATTERN",
    "SPEC_VERSION_PATTERN",
    "SecretKeyRef",
    "SourceMode",
    "SourceSpec",
    "StrategySpec",
    "WeightUpdate",
    "WeightUpdateSpec",
    "WeightUpdateStatus",
    "format_validation_error",
    "parse_spec",
    "resolve_max_unavailable",
]

GROUP = "weightroll.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightUpdate"
PLURAL = "weightupdates"
SINGULAR = "weightupdate"
SHORT_NAME = "wu"

#: Percentages are whole numbers followed by ``%`` (Kubernetes ``intstr`` style).
_PERCENT_RE = re.compile(r"^(\d{1,3})%$")
#: A label key: optional DNS prefix, then a name (used for ``groupBy`` and ``trafficLabel``).
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)

#: A version of a WeightUpdate: lower-case letters, digits, ``.`` and ``-`` (a subset of the
#: agent's ``VERSION_PATTERN``). The agent update id is derived from the version, so two
#: spellings that would give the same id (``V2_1`` and ``v2-1``) are not both allowed: only the
#: canonical one is (issue 11 finding 9).
SPEC_VERSION_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$"
#: Sources the agents read: an absolute path or a ``file://`` URI (as ``engine_agent.protocol``).
LOCAL_URI_PATTERN = r"^(file://)?/"
_LOCAL_URI_RE = re.compile(LOCAL_URI_PATTERN)
assert re.fullmatch(VERSION_PATTERN, "v2-1.a")  # the spec's versions are the agent's versions

Version = Annotated[str, StringConstraints(pattern=SPEC_VERSION_PATTERN)]
LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN, max_length=317)]


class Model(BaseModel):
    """Base of every resource model: camelCase JSON, snake_case attributes, no unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    def to_json_dict(self) -> dict[str, Any]:
        """Return the JSON-ready dict with camelCase keys, ``None`` fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------------------------
# spec
# --------------------------------------------------------------------------------------------


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(Model):
    """One ``matchExpressions`` entry of a Kubernetes label selector."""

    key: LabelKey
    operator: SelectorOperator
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        needs_values = self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
        if needs_values and not self.values:
            raise ValueError(f"values must not be empty when operator is {self.operator.value}")
        if not needs_values and self.values:
            raise ValueError(f"values must be empty when operator is {self.operator.value}")
        return self


class LabelSelector(Model):
    """Label selector of the vLLM pods (``matchLabels`` and/or ``matchExpressions``)."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)

    @model_validator(mode="after")
    def _not_empty(self) -> Self:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(
                "spec.selector must not be empty: an empty selector would select every pod in "
                "the namespace; set matchLabels or matchExpressions"
            )
        return self


class SourceMode(StrEnum):
    """How much of the model the new weights carry."""

    #: Every tensor of the model.
    FULL = "full"
    #: A sparse patch against ``baseVersion``.
    SPARSE = "sparse"


class SourceSpec(Model):
    """Where the new weights are, as the agents see it (an absolute path or ``file://`` URI)."""

    uri: str = Field(min_length=1)
    #: Optional checkpoint manifest (``weightroll manifest``); every byte is checked against it.
    manifest: str | None = None
    mode: SourceMode = SourceMode.FULL
    #: Required for ``sparse``: the version the patch was computed against.
    base_version: Version | None = None

    @field_validator("uri", "manifest")
    @classmethod
    def _local(cls, value: str | None) -> str | None:
        if value is not None and not _LOCAL_URI_RE.match(value):
            raise ValueError(
                f"must be an absolute path or a file:// URI, got {value!r} (the agents read "
                "local files only)"
            )
        return value

    @model_validator(mode="after")
    def _sparse_needs_base(self) -> Self:
        if self.mode is SourceMode.SPARSE and self.base_version is None:
            raise ValueError("spec.source.baseVersion is required when spec.source.mode is sparse")
        if self.mode is SourceMode.FULL and self.base_version is not None:
            raise ValueError(
                "spec.source.baseVersion is only allowed when spec.source.mode is sparse"
            )
        return self


class DrainMode(StrEnum):
    """How the agent pauses generation before the reload (see ``engine_agent.protocol``)."""

    WAIT = "wait"
    ABORT = "abort"


class DrainSpec(Model):
    mode: DrainMode = DrainMode.WAIT
    #: Seconds the agent waits for in-flight requests before aborting them.
    timeout_seconds: int = Field(default=60, ge=0, le=3600)


class OnFailure(StrEnum):
    """What happens when more than ``maxFailedReplicas`` units fail."""

    #: Stop starting units; failed units stay drained; phase Failed.
    HALT = "Halt"
    #: Reload every touched unit in place to the version and source it had before.
    ROLLBACK = "Rollback"


class StrategySpec(Model):
    """How the rollout moves through the fleet."""

    #: Units (pods, or groups with ``groupBy``) that may be unavailable at once, counting units
    #: already not ready: an integer >= 1 or a percentage in (0%, 100%] (rounded down, min 1).
    max_unavailable: int | str = 1
    #: Units updated first; the rest waits until all of them are verified.
    canary: int | None = Field(default=None, ge=1)
    #: Hold after the canary until this is set to false (the promote step).
    pause_after_canary: bool = False
    drain: DrainSpec = Field(default_factory=DrainSpec)
    #: Label removed from a pod while it is drained, for routers that ignore Pod readiness.
    traffic_label: LabelKey | None = None
    #: Seconds one unit may take from drain to verdict before it counts as failed.
    update_timeout_seconds: int = Field(default=600, ge=1)
    #: Seconds without progress before the rollout is Failed.
    progress_deadline_seconds: int = Field(default=1800, ge=1)
    on_failure: OnFailure = OnFailure.HALT
    #: Failed units tolerated before ``onFailure`` applies.
    max_failed_replicas: int = Field(default=0, ge=0)

    @field_validator("max_unavailable")
    @classmethod
    def _check_max_unavailable(cls, value: int | str) -> int | str:
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"must be at least 1 or a percentage, got {value}")
            return value
        match = _PERCENT_RE.match(value)
        if match is None:
            raise ValueError(f"must be an integer or a percentage like '10%', got {value!r}")
        percent = int(match.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"must be a percentage in (0%, 100%], got {value!r}")
        return value


class SecretKeyRef(Model):
    """A key of a Secret in the WeightUpdate's namespace."""

    name: str = Field(min_length=1)
    key: str = Field(default="token", min_length=1)


class AgentSpec(Model):
    """How the operator reaches the pod agents."""

    #: Used when the pod has no container port named ``weightroll``.
    port: int = Field(default=8470, ge=1, le=65535)
    #: Bearer token for the agent's ``/v1`` routes; no token is sent without it.
    token_secret_ref: SecretKeyRef | None = None


class WeightUpdateSpec(Model):
    """What the platform team asks for: this version on every selected pod."""

    selector: LabelSelector
    version: Version
    source: SourceSpec
    #: Pods sharing this label's value are updated and verified as one unit (LWS groups).
    group_by: LabelKey | None = None
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    #: Hold new units (in-flight ones finish).
    paused: bool = False
    agent: AgentSpec = Field(default_factory=AgentSpec)


def format_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    """Render a pydantic error as ``spec.a.b: message; ...`` with JSON field names.

    Messages that already name their field (model-level checks) are kept as they are.
    """
    parts: list[str] = []
    for item in error.errors():
        path = ".".join([prefix, *(str(p) for p in item["loc"])])
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        parts.append(message if message.startswith(f"{prefix}.") else f"{path}: {message}")
    return "; ".join(parts)


def parse_spec(raw: Any) -> WeightUpdateSpec:
    """Parse a raw ``spec`` dict.

    Raises:
        ValueError: naming every offending field (see :func:`format_validation_error`).
    """
    try:
        return WeightUpdateSpec.model_validate(raw)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from e


def resolve_max_unavailable(value: int | str, total: int) -> int:
    """Resolve ``maxUnavailable`` against ``total`` units: percentages round down, minimum 1.

    >>> resolve_max_unavailable("10%", 1000), resolve_max_unavailable("10%", 5)
    (100, 1)
    """
    if isinstance(value, int):
        return value
    match = _PERCENT_RE.match(value)
    if match is None:  # pragma: no cover - the model validated it
        raise ValueError(f"bad maxUnavailable {value!r}")
    return max(1, total * int(match.group(1)) // 100)


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"


class ConditionType(StrEnum):
    PROGRESSING = "Progressing"
    VERIFIED = "Verified"
    DEGRADED = "Degraded"
    PAUSED = "Paused"
    BLOCKED = "Blocked"
    INVALID_SPEC = "InvalidSpec"
    #: Set False while the agent token Secret cannot be read (``credentials.py``).
    AGENT_TOKEN_AVAILABLE = "AgentTokenAvailable"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    type: ConditionType
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class ReplicaCounts(Model):
    """Pods by state (a pod is in exactly one of updated/draining/failed/stale or none)."""

    total: int = 0
    updated: int = 0
    verified: int = 0
    draining: int = 0
    failed: int = 0
    stale: int = 0


class PodResult(Model):
    """One pod's outcome; failed pods are always listed, others while the list has room."""

    name: str
    state: str
    version: str | None = None
    reason: str | None = None
    unit: str | None = None


class WeightUpdateStatus(Model):
    """The aggregate the operator recomputes every pass (plus the few persisted intents)."""

    phase: Phase = Phase.PENDING
    observed_generation: int | None = None
    #: The version the persisted fields below belong to; a new spec.version resets them.
    target_version: str | None = None
    replicas: ReplicaCounts = Field(default_factory=ReplicaCounts)
    #: The version the fleet served before this rollout (the rollback target when uniform).
    stable_version: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    pods: list[PodResult] = Field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    #: Persisted: last time a unit changed state (for progressDeadlineSeconds).
    last_progress_time: str | None = None
    #: Persisted intent: the rollout was halted (failure budget or deadline) and why.
    aborted_at: str | None = None
    abort_reason: str | None = None
    message: str = ""


class WeightUpdate(Model):
    """The whole object as the operator parses it (metadata kept as a plain dict)."""

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: WeightUpdateSpec
    status: WeightUpdateStatus | None = None
