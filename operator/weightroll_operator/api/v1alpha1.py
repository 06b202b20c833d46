"""The ``WeightUpdate`` resource (``weightroll.io/v1alpha1``): the one typed source of truth.

``crds/weightupdates.weightroll.io.yaml`` is generated from these models by
:mod:`weightroll_operator.api.crdgen`; a test fails when they drift.

Invariants:
    * Every model forbids unknown fields, so a typo in a spec is an error naming the field.
    * JSON is camelCase (Kubernetes style); attributes are snake_case; both parse.
    * Validation messages name the field by its JSON path (``spec.strategy.maxUnavailable``), so
      the same text reads well in an ``InvalidSpec`` condition and in a CLI error.
    * One text per field: each field's attribute docstring (``use_attribute_docstrings``) is its
      description in the CRD (so ``kubectl explain``) and its meaning in docs/api.md; docstrings
      are user-facing Markdown (single backticks). A test fails when a CRD property has none.

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

from engine_agent.protocol import MANIFEST_DIGEST_PATTERN, VERSION_PATTERN
from weightroll_operator.api.names import ObjectName, SecretKey

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
        use_attribute_docstrings=True,
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
    """One `matchExpressions` entry of a Kubernetes label selector."""

    key: LabelKey
    """The label key the requirement applies to."""
    operator: SelectorOperator
    """`In`, `NotIn`, `Exists` or `DoesNotExist` (Kubernetes semantics)."""
    values: list[str] = Field(default_factory=list)
    """Label values: non-empty for `In` and `NotIn`, empty for `Exists` and `DoesNotExist`."""

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        needs_values = self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
        if needs_values and not self.values:
            raise ValueError(f"values must not be empty when operator is {self.operator.value}")
        if not needs_values and self.values:
            raise ValueError(f"values must be empty when operator is {self.operator.value}")
        return self


class LabelSelector(Model):
    """Label selector of the vLLM pods (`matchLabels` and/or `matchExpressions`)."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    """Labels a pod must carry, each with exactly this value (ANDed with `matchExpressions`)."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)
    """Label requirements a pod must meet, all of them (ANDed with `matchLabels`)."""

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
    """Where the new weights are, as the agents see it (an absolute path or `file://` URI)."""

    uri: str = Field(min_length=1)
    """Where the agents read the weights: an absolute path or `file://` URI inside the pod
    (other schemes are reported as `InvalidSpec`). A directory of safetensors files, or one
    patch file for `sparse`."""
    manifest: str | None = None
    """Checkpoint manifest (`weightroll manifest`), path or `file://` URI; every byte each rank
    reads is checked against it before it reaches a live tensor."""
    manifest_digest: str | None = Field(default=None, pattern=MANIFEST_DIGEST_PATTERN)
    """Pin of the manifest: `sha256:` and 64 lower-case hex digits of the manifest file's exact
    bytes, as `weightroll manifest` prints it. Requires `source.manifest`. An agent whose
    manifest hashes otherwise fails the update before draining (nothing is written); without
    it, whoever can write the model volume can replace checkpoint and manifest together."""
    mode: SourceMode = SourceMode.FULL
    """`full`: every tensor of the model; `sparse`: a patch against `source.baseVersion`
    (required then)."""
    base_version: Version | None = None
    """The version a sparse patch was computed against; required with `sparse`, refused with
    `full`."""

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
        if self.manifest_digest is not None and self.manifest is None:
            raise ValueError(
                "spec.source.manifestDigest pins a manifest: spec.source.manifest is required"
            )
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
    """How the agent stops generation on a pod before its reload (traffic is already away)."""

    mode: DrainMode = DrainMode.WAIT
    """How the agent pauses generation before the reload: `wait` lets running requests finish
    (up to the timeout, then aborts them), `abort` aborts them at once."""
    timeout_seconds: int = Field(default=60, ge=0, le=3600)
    """How long the agent waits for in-flight requests (seconds)."""


class PrefetchMode(StrEnum):
    """Whether the agent reads the checkpoint before the drain (see ``engine_agent.protocol``)."""

    NONE = "None"
    HOST = "Host"


class PrefetchSpec(Model):
    """Read and verify the checkpoint into host memory before the drain (agent issue 30)."""

    mode: PrefetchMode = PrefetchMode.NONE
    """`Host`: every rank of a pod reads and verifies the whole checkpoint into host memory
    before the agent drains it, so the pause holds only the apply; a failure there leaves the
    pod serving its old weights. `None`: read inside the drain. Not for `sparse` sources."""
    max_bytes: int | None = Field(default=None, ge=1)
    """Most bytes one rank may stage in host memory (the host's available memory is always
    checked too); above it the pod's update fails `prefetch_memory` before any read."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """With `Host`: units whose prefetch may run (or wait, verified, for the drain) at once,
    while they still serve; it does not use `maxUnavailable`. A unit is drained only once every
    pod's prefetch verified. Unset: the resolved `maxUnavailable` (one batch ahead)."""


class OnFailure(StrEnum):
    """What happens when more than ``maxFailedReplicas`` units fail."""

    #: Stop starting units; failed units stay drained; phase Failed.
    HALT = "Halt"
    #: Reload every touched unit in place to the version and source it had before.
    ROLLBACK = "Rollback"


class StrategySpec(Model):
    """How the rollout moves through the fleet."""

    max_unavailable: int | str = 1
    """Units (pods, or groups with `groupBy`) unavailable at once: an integer >= 1 or `"N%"`
    with 0 < N <= 100 (rounded down, at least 1), **counting units already not ready**. The
    rollout itself keeps at most this many units out of traffic: claiming a unit NotReady for
    another reason (a readiness blip) takes a slot too, as it stays out for the whole reload;
    only a unit our gate already holds out (a new pod) is free."""
    canary: int | None = Field(default=None, ge=1)
    """Units updated first; the rest waits until every canary unit has a verdict."""
    pause_after_canary: bool = False
    """Hold after the canary (phase `Paused`, reason `CanaryComplete`); set it to `false` to
    promote (`weightroll promote`)."""
    drain: DrainSpec = Field(default_factory=DrainSpec)
    """How the agent stops generation on a pod before its reload."""
    prefetch: PrefetchSpec = Field(default_factory=PrefetchSpec)
    """Whether the agent reads the checkpoint before the drain. The operator passes it through
    only: the pod is still taken out of traffic before the agent is asked."""
    traffic_label: LabelKey | None = None
    """Also removed from a pod while it is drained and restored afterwards, for routers that
    ignore Pod readiness. Keep it out of your workload's own selector."""
    update_timeout_seconds: int = Field(default=600, ge=1)
    """Limit per unit from its drain to the agents' verdict (seconds); past it the update is
    aborted and the unit fails (it stays drained)."""
    progress_deadline_seconds: int = Field(default=1800, ge=1)
    """No unit transition for this long (seconds) while work is left: phase `Failed` (reason
    `ProgressDeadlineExceeded`). Must be greater than `updateTimeoutSeconds`. Counts the
    current attempt only: not while paused or `Blocked`, not before a retry, and not at all
    once the rollout completed (pods joining later are converged and reported, never a
    halt)."""
    on_failure: OnFailure = OnFailure.HALT
    """When the rollout halts (more than `maxFailedReplicas` units failed, a failed canary,
    the progress deadline): `Halt` stops starting units (failed units stay drained);
    `Rollback` reloads every touched unit in place to the version and source it served
    before. A completed rollout never judges the version again: a pod failing after
    completion is reported (`Failed`, condition `Degraded`) and the verified pods are left
    alone; only failed pods holding every `maxUnavailable` slot while pods wait halt it, and
    that halt never rolls back."""
    max_failed_replicas: int = Field(default=0, ge=0)
    """Failed units tolerated: they stay drained and reported (condition `Degraded`), and the
    rollout goes on and completes (phase `Succeeded`, `Degraded=True`). One more failure halts
    it (`onFailure`). Tolerated failed units use the `maxUnavailable` budget, so this must be
    less than a numeric `maxUnavailable`; when they hold all of it while units still wait,
    the rollout halts at once (`FailureBudgetExceeded`)."""

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

    name: ObjectName = Field(min_length=1)
    """Name of the Secret (in the WeightUpdate's namespace): a Kubernetes object name
    (lower-case DNS-1123 subdomain), so it can never name a path into another namespace."""
    key: SecretKey = Field(default="token", min_length=1)
    """Key of the Secret's `data` holding the value (`[-._a-zA-Z0-9]`, not `.` or `..`)."""


class AgentSpec(Model):
    """How the operator reaches the pod agents."""

    port: int | None = Field(default=None, ge=1, le=65535)
    """Deprecated check: the operator only calls the container port named `weightroll` of a
    selected pod; when set, every selected pod's `weightroll` port must equal it (`InvalidSpec`
    otherwise)."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret (in the WeightUpdate's namespace) holding the agents' bearer token (its first line
    is sent); it must carry the label `weightroll.io/agent-token: "true"` (`InvalidSpec`
    otherwise). Without it no token is sent and agents answer 401."""


class WeightUpdateSpec(Model):
    """What to roll out: this version on every selected pod."""

    selector: LabelSelector
    """The vLLM pods (`matchLabels` and/or `matchExpressions`, Kubernetes semantics); must not
    be empty. Pods being deleted are left out."""
    version: Version
    """The weight version to serve; also written to the pod label
    `weightroll.io/weight-version` when a pod is restored."""
    source: SourceSpec
    """Where the new weights are, as the agents see it."""
    group_by: LabelKey | None = None
    """Pods sharing this label's value (e.g. a LeaderWorkerSet group) form one *unit*: drained,
    updated, verified and restored together. Without it each pod is a unit."""
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    """How the rollout moves through the fleet."""
    paused: bool = False
    """Hold new units; units in flight finish (phase `Paused`, reason `PausedBySpec`)."""
    agent: AgentSpec = Field(default_factory=AgentSpec)
    """How the operator reaches the pod agents."""


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
    """One condition of the rollout (Kubernetes style)."""

    type: ConditionType
    """`Progressing`, `Verified`, `Degraded`, `Paused`, `Blocked`, `InvalidSpec` or
    `AgentTokenAvailable`."""
    status: ConditionStatus
    """`True`, `False` or `Unknown`."""
    reason: str = ""
    """CamelCase reason, also an Event reason (docs/api.md, "Condition reasons")."""
    message: str = ""
    """One line for humans."""
    last_transition_time: str | None = None
    """When `status` last changed (RFC 3339)."""


class ReplicaCounts(Model):
    """Pods by state (a pod is in exactly one of updated/draining/failed/stale or none)."""

    total: int = 0
    """Pods the selector selects."""
    updated: int = 0
    """Pods serving the version."""
    verified: int = 0
    """Updated pods whose traffic is restored (their gate is True)."""
    draining: int = 0
    """Pods in flight: drained, reloading or verifying."""
    failed: int = 0
    """Pods whose update failed (they stay drained)."""
    stale: int = 0
    """Pods not at the version and not being worked on: paused, halted, blocked, superseded,
    agent unreachable."""


class PodResult(Model):
    """One pod's outcome; failed pods are always listed, others while the list has room."""

    name: str
    """Pod name."""
    state: str
    """`Verified`, `Updating`, `Prefetching` (`prefetch.mode: Host`: reading ahead of its
    drain, still serving), `Pending`, `Failed`, `RolledBack`, `Blocked`, `Superseded` or
    `Unknown`."""
    version: str | None = None
    """The version of the pod's weight-state annotation."""
    reason: str | None = None
    """Why the pod failed or waits."""
    unit: str | None = None
    """The unit the pod belongs to (its `groupBy` label value); absent without `groupBy`."""
    step: str | None = None
    """Where a pod being worked on stands: `Prefetching`, `Prefetched` (reading ahead of its
    drain, still serving; `prefetch.mode: Host`), `Draining`, `Swapping` (paused, the new
    weights written), `Verifying`, then `Ready` (verified, traffic back)."""


class WeightUpdateStatus(Model):
    """Aggregate state recomputed by the operator every pass (plus the few persisted intents)."""

    phase: Phase = Phase.PENDING
    """Where the rollout stands: `Pending`, `Progressing`, `Paused`, `Succeeded`, `Failed`,
    `RollingBack` or `RolledBack`."""
    observed_generation: int | None = None
    """`metadata.generation` of the spec this status is about."""
    target_version: str | None = None
    """The `spec.version` the persisted fields belong to; a new `spec.version` resets them."""
    replicas: ReplicaCounts = Field(default_factory=ReplicaCounts)
    """Pods by state: `total`, `updated` (serving the version), `verified` (updated and traffic
    restored), `draining` (in flight), `failed`, `stale` (not at the version and not being
    worked on: paused, halted, blocked, superseded, agent unreachable)."""
    stable_version: str | None = None
    """What the fleet served before (when every touched pod served the same version); the
    version itself after success."""
    conditions: list[Condition] = Field(default_factory=list)
    """`Progressing`, `Verified`, `Degraded`, `Paused`, `Blocked`, `InvalidSpec`,
    `AgentTokenAvailable`, each with a reason (listed in docs/api.md, "Condition reasons")."""
    pods: list[PodResult] = Field(default_factory=list)
    """Up to 50 pods (failed pods always listed, even past 50) with `name`, `state`
    (`Verified`, `Updating`, `Pending`, `Failed`, `RolledBack`, `Blocked`, `Superseded`,
    `Unknown`), the `version` of the pod's weight-state annotation, a `reason` and, with
    `groupBy`, the `unit`."""
    start_time: str | None = None
    """When the first unit was claimed (RFC 3339)."""
    completion_time: str | None = None
    """When every selected pod first served the version (RFC 3339); stays set (convergence of
    later pods does not clear it)."""
    last_progress_time: str | None = None
    """Last unit transition (RFC 3339; for `progressDeadlineSeconds`)."""
    aborted_at: str | None = None
    """Persisted halt intent (failure budget, deadline, failed canary, `weightroll abort`; RFC
    3339). `weightroll retry` clears it and `abortReason`; so does a new `spec.version`."""
    abort_reason: str | None = None
    """Why the rollout halted: `FailureBudgetExceeded`, `ProgressDeadlineExceeded`, `CanaryFailed`
    or `AbortedByUser`."""
    retried_at: str | None = None
    """Persisted intent of `weightroll retry` (RFC 3339): pods whose attempt failed or was rolled
    back before it are updated again by fresh attempts; the progress clock restarts."""
    message: str = ""
    """One line, e.g. `Progressing: 37/100 pods verified at v2; 10 updating`."""


class WeightUpdate(Model):
    """The whole object as the operator parses it (metadata kept as a plain dict)."""

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: WeightUpdateSpec
    status: WeightUpdateStatus | None = None
