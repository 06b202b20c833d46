"""The document ``weightroll status -o json|yaml`` prints, as pydantic models.

The models are the one source of that document: :func:`view_schema` (its JSON Schema, which a
pipeline can validate against) and the field table of docs/api.md are generated from them, and
``status_view.view`` builds the document through them, so the output cannot drift from what is
documented. Each field's meaning is its attribute docstring (``use_attribute_docstrings``).

Invariants: keys are camelCase in model order; every key is always present (``null`` where the
WeightUpdate reports nothing); no other key is allowed (``extra="forbid"``). Additive changes
keep ``schemaVersion`` 1; it changes only for incompatible ones.

Validation is strict (no ``"3"`` for ``3``): the models check a document, they do not repair one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from weightroll_operator.api.v1alpha1 import Phase

__all__ = [
    "JSON_SCHEMA_DIALECT",
    "SCHEMA_VERSION",
    "ConditionStatus",
    "ExitCode",
    "Result",
    "StatusView",
    "ViewCondition",
    "ViewEvent",
    "ViewPod",
    "ViewReplicas",
    "view_schema",
]

#: The JSON Schema dialect pydantic generates (``$defs``, ``const``).
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: ``schemaVersion`` of the documents this module describes; additive changes keep it.
SCHEMA_VERSION: Literal[1] = 1
#: A condition's state, as Kubernetes spells it.
ConditionStatus = Literal["True", "False", "Unknown"]
#: The outcome for a pipeline, one per exit status below.
Result = Literal["Succeeded", "Failed", "NotFinished"]
#: The exit statuses that come with a document (1 and 2 print none: no object was read).
ExitCode = Literal[0, 3, 4]


class _Document(BaseModel):
    """Base of the document's objects: camelCase keys, no unknown key, strict types."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
    )


class ViewReplicas(_Document):
    """Pods by state (status.replicas; 0 when absent)."""

    total: int = Field(ge=0)
    """Pods total (status.replicas)."""
    updated: int = Field(ge=0)
    """Pods updated (status.replicas)."""
    verified: int = Field(ge=0)
    """Pods verified (status.replicas)."""
    draining: int = Field(ge=0)
    """Pods draining (status.replicas)."""
    failed: int = Field(ge=0)
    """Pods failed (status.replicas)."""
    stale: int = Field(ge=0)
    """Pods stale (status.replicas)."""


class ViewCondition(_Document):
    """One entry of status.conditions."""

    type: str
    """Progressing, Verified, Degraded, ..."""
    status: ConditionStatus
    """The condition's state."""
    reason: str
    """CamelCase reason (docs/api.md)."""
    message: str
    """One line for humans."""
    last_transition_time: str | None
    """RFC 3339; null when not reported."""


class ViewPod(_Document):
    """One entry of status.pods."""

    name: str
    """Pod name."""
    state: str
    """Verified, Updating, Pending, Failed, ..."""
    version: str | None
    """Version of the pod's weight-state annotation."""
    reason: str | None
    """Why the pod failed or waits."""
    unit: str | None
    """The unit (groupBy value); null without groupBy."""
    step: str | None
    """Where a pod being worked on stands: Prefetching, Prefetched, Draining, Swapping,
    Verifying, Ready; null for the others."""


class ViewEvent(_Document):
    """One recent Event of the WeightUpdate."""

    time: str | None
    """lastTimestamp of the Event (RFC 3339)."""
    type: str
    """Normal or Warning."""
    reason: str
    """CamelCase reason."""
    message: str
    """The Event's message."""
    count: int
    """How often the Event occurred."""


class StatusView(_Document):
    """One WeightUpdate as ``weightroll status -o json|yaml`` prints it."""

    model_config = ConfigDict(title="weightroll status -o json")

    # No default: a document without it is not one of ours (the model rejects it, too).
    schema_version: Literal[1]
    """Version of this document's schema."""
    namespace: str
    """Namespace of the WeightUpdate."""
    name: str
    """Name of the WeightUpdate."""
    version: str | None
    """spec.version: the version being rolled out."""
    generation: int | None
    """metadata.generation of the spec."""
    observed_generation: int | None
    """The generation the status is about; null before the first pass."""
    current: bool
    """observedGeneration equals generation: the phase is about this spec."""
    # strict=False for this field only: the enum accepts the phase string the API server holds.
    phase: Phase = Field(strict=False)
    """status.phase (Pending when there is no status yet)."""
    result: Result
    """What the exit status means: the rollout's outcome for a pipeline."""
    exit_code: ExitCode
    """The command's exit status: 0 Succeeded, 3 Failed, 4 not finished."""
    message: str
    """status.message: one line."""
    stable_version: str | None
    """What the fleet served before this rollout."""
    replicas: ViewReplicas
    """Pods by state (status.replicas; 0 when absent)."""
    conditions: list[ViewCondition]
    """status.conditions."""
    pods: list[ViewPod]
    """status.pods."""
    events: list[ViewEvent]
    """The most recent Events of the WeightUpdate, oldest first (--events)."""

    def to_document(self) -> dict[str, Any]:
        """The JSON-ready document: camelCase keys in model order, ``null`` fields kept."""
        return self.model_dump(mode="json", by_alias=True)


def view_schema() -> dict[str, Any]:
    """JSON Schema of ``weightroll status -o json|yaml``, generated from :class:`StatusView`."""
    schema = StatusView.model_json_schema(by_alias=True, mode="serialization")
    return {"$schema": JSON_SCHEMA_DIALECT, **schema}
