"""The sidecar's HTTP API, as the operator calls it: :class:`UpdateRequest` in,
:class:`UpdateStatus` and :class:`AgentState` out (docs/api.md renders these models)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

from engine_agent.protocol.rank import (
    EngineState,
    RankReport,
    RankStatus,
    UpdateMode,
    UpdateSpec,
)
from engine_agent.protocol.wire import (
    MANIFEST_DIGEST_PATTERN,
    UpdateId,
    Version,
    WireModel,
)


class DrainMode(StrEnum):
    """How generation is paused before the reload (vLLM ``/pause?mode=``)."""

    #: Let running requests finish (up to the timeout), then abort what is left.
    WAIT = "wait"
    #: Abort running requests at once.
    ABORT = "abort"


class DrainSpec(WireModel):
    mode: DrainMode = DrainMode.WAIT
    timeout_seconds: int = Field(default=60, ge=0, le=3600)


_URI_RE = re.compile(r"^(file://)?/[^\x00]*$")


class SourceSpec(WireModel):
    """Where the new weights are: a local path or ``file://`` URI, optionally with a manifest."""

    uri: str
    manifest: str | None = None
    #: ``sha256:<hex>`` of the manifest file's bytes (``weightroll manifest`` prints it): the
    #: agent refuses the update before draining, so before any write to the engine, when the
    #: manifest it reads hashes otherwise. Requires ``manifest``.
    manifest_digest: str | None = Field(default=None, pattern=MANIFEST_DIGEST_PATTERN)

    @model_validator(mode="after")
    def _local_uri(self) -> Self:
        for name in ("uri", "manifest"):
            value = getattr(self, name)
            if value is not None and not _URI_RE.match(value):
                raise ValueError(
                    f"source.{name} must be an absolute path or a file:// URI, got {value!r}; "
                    "other schemes are not supported by this agent"
                )
        if self.manifest_digest is not None and self.manifest is None:
            raise ValueError(
                "source.manifestDigest pins a manifest, so source.manifest is required"
            )
        return self

    @property
    def path(self) -> str:
        return self.uri.removeprefix("file://")

    @property
    def manifest_path(self) -> str | None:
        return None if self.manifest is None else self.manifest.removeprefix("file://")


class PrefetchMode(StrEnum):
    """Whether the checkpoint is read before the drain (``Host``) or inside it (``None``)."""

    #: Today's path: every byte is read inside the drain.
    NONE = "None"
    #: Every rank reads and verifies its checkpoint into host memory while the replica serves;
    #: the drain only processes it and writes it into live storage (docs/engine.md, Prefetch).
    HOST = "Host"


class PrefetchSpec(WireModel):
    """``prefetch`` of an update: read before the drain, within a memory bound."""

    mode: PrefetchMode = PrefetchMode.NONE
    #: The most bytes one rank may stage in host memory (``null``: bounded only by the host's
    #: available memory, which is always checked).
    max_bytes: int | None = Field(default=None, ge=1)
    #: ``true``: stop in ``Prefetched`` with the replica serving and Ready until
    #: ``POST /v1/updates/{id}/swap`` (the operator claims the pod for the drain first);
    #: ``false``: drain as soon as every rank is ready.
    await_swap: bool = False
    #: Bound of the wait for the swap: a parked update nobody swaps frees its staging and
    #: ends ``Failed`` (``swap_deadline``) with the replica serving, never poisoned.
    swap_deadline_seconds: int = Field(default=600, ge=1, le=86400)

    @model_validator(mode="after")
    def _swap_needs_host(self) -> Self:
        if self.await_swap and self.mode is not PrefetchMode.HOST:
            raise ValueError("prefetch.awaitSwap needs prefetch.mode 'Host'")
        return self


class UpdateRequest(WireModel):
    """Body of ``POST /v1/updates``."""

    id: UpdateId
    version: Version
    source: SourceSpec
    mode: UpdateMode = UpdateMode.FULL
    base_version: Version | None = None
    scope: list[str] | None = None
    drain: DrainSpec = DrainSpec()
    prefetch: PrefetchSpec = PrefetchSpec()

    @model_validator(mode="after")
    def _mode_fields(self) -> Self:
        if self.prefetch.mode is PrefetchMode.HOST and self.mode is UpdateMode.SPARSE:
            # A patch is planned against, and written into, the live bytes: there is nothing to
            # stage ahead that the drain would not have to redo.
            raise ValueError(
                "prefetch.mode 'Host' is not supported for sparse updates; use mode 'None'"
            )
        UpdateSpec(
            update_id=self.id,
            version=self.version,
            mode=self.mode,
            base_version=self.base_version,
            scope=self.scope,
        )
        return self

    def engine_spec(self, base_update_id: str | None = None) -> UpdateSpec:
        """The ranks' session for this request; ``base_update_id``: the commit a delta builds
        on (the agent's last commit; ignored for full updates)."""
        return UpdateSpec(
            update_id=self.id,
            version=self.version,
            mode=self.mode,
            base_version=self.base_version,
            base_update_id=None if self.mode is UpdateMode.FULL else base_update_id,
            scope=self.scope,
        )


class UpdatePhase(StrEnum):
    PENDING = "Pending"
    #: The ranks read and verify the checkpoint into host staging; the replica still serves.
    PREFETCHING = "Prefetching"
    #: Every rank holds the verified checkpoint; the drain comes next.
    PREFETCHED = "Prefetched"
    DRAINING = "Draining"
    LOADING = "Loading"
    VERIFYING = "Verifying"
    COMMITTED = "Committed"
    FAILED = "Failed"
    ABORTED = "Aborted"

    @property
    def terminal(self) -> bool:
        return self in (UpdatePhase.COMMITTED, UpdatePhase.FAILED, UpdatePhase.ABORTED)


class Verdict(WireModel):
    """The agent's decision on one update: committed or not, and why."""

    committed: bool
    reasons: list[str] = Field(default_factory=list)


class UpdateStatus(WireModel):
    """Body of ``GET /v1/updates/{id}``."""

    id: str
    version: str
    mode: UpdateMode
    phase: UpdatePhase
    ranks: list[RankReport] = Field(default_factory=list)
    verdict: Verdict | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    started_at: str | None = None
    finished_at: str | None = None
    message: str = ""


class AgentState(WireModel):
    """Body of ``GET /v1/state``: what the ranks serve *now*, not what the agent last recorded.

    ``version`` is the live version every rank reports (``weightroll_state``), ``""`` when the
    ranks cannot be asked or disagree; ``ranks`` is empty exactly when they cannot be asked
    (vLLM booting or down), so a caller can tell the two apart. ``committed_version`` and
    ``committed_update_id`` are the agent's record of its last commit; ``committed_update_id``
    is reported only while the ranks still serve that commit (clean, at ``committed_version``),
    so a vLLM restarted under the agent (boot weights again) reports ``None`` and a caller never
    takes an old verdict for a live one.
    """

    version: str
    engine_state: EngineState
    ready: bool
    paused: bool
    active_update_id: str | None = None
    ranks: list[RankStatus] = Field(default_factory=list)
    #: Where the weights now served came from, so a rollback target is known.
    source: SourceSpec | None = None
    message: str = ""
    #: The version the agent last committed (its record; ``version`` is what the ranks serve).
    committed_version: str | None = None
    #: The update id that committed what the ranks serve now; ``None`` when they do not serve it
    #: (restarted, poisoned, in an update) or nothing was committed since the agent started.
    committed_update_id: str | None = None
