"""Wire models shared by the worker extension, the pod sidecar and the operator.

This module is the one contract between the three processes that take part in an update:

* the **worker extension** (``engine_agent.vllm_extension``) runs inside every vLLM rank and is
  called through ``collective_rpc``; its methods take one JSON string and return a plain dict
  that validates as :class:`RankReport` or :class:`RankStatus`;
* the **sidecar** (``weightroll-agent``) serves the operator over HTTP with :class:`UpdateRequest`,
  :class:`UpdateStatus` and :class:`AgentState`;
* the **operator** imports nothing else from the agent side.

Invariants:
    * No torch or vLLM import here: the operator image has neither.
    * Every model forbids unknown fields, so a typo is a 422 naming the field rather than a
      silently ignored option.
    * JSON uses camelCase (Kubernetes style); Python attributes are snake_case and both spellings
      are accepted on input.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

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

#: A weight version is also written as a label value on pods, so it follows label-value rules.
VERSION_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
#: Poison reason prefix of a rank whose live weights changed after its verified commit
#: (engine_agent/reload/guard.py); the agent holds the replica under this code.
STILL_TRUE_VIOLATED = "still_true_violated"
#: Update ids are chosen by the operator (``<cr-uid-prefix>-<version>``) or by a user.
UPDATE_ID_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,125}[a-z0-9])?$"
#: A pinned manifest: ``sha256:`` and the lower-case hex SHA-256 of the manifest file's bytes,
#: exactly as ``weightroll manifest`` prints it (``engine_agent.manifest.manifest_file_digest``).
MANIFEST_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"

Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
UpdateId = Annotated[str, StringConstraints(pattern=UPDATE_ID_PATTERN)]


class WireModel(BaseModel):
    """Base for every wire model: camelCase JSON, snake_case attributes, no unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """Return the JSON-ready dict (camelCase keys, enums as strings, ``None`` kept)."""
        return self.model_dump(mode="json", by_alias=True)


class EngineState(StrEnum):
    """Weight state of one rank (engine-reload.md R3).

    ``CLEAN`` is the only state that serves: every weight belongs to ``version``. ``OPEN`` is a
    session that has not written a live byte yet. ``DIRTY`` means live bytes changed and the
    session has not committed. ``POISONED`` is a failed or aborted dirty session; only a full
    update that commits leaves it.
    """

    CLEAN = "clean"
    OPEN = "open"
    DIRTY = "dirty"
    POISONED = "poisoned"


class UpdateMode(StrEnum):
    """How much of the model an update carries."""

    #: Every required shard of every module.
    FULL = "full"
    #: Only the modules named by ``scope``, on top of ``base_version``; every other shard stays
    #: bit-identical.
    PARTIAL = "partial"
    #: Flat-index patches in checkpoint coordinates against ``base_version``.
    SPARSE = "sparse"


class UpdateSpec(WireModel):
    """Argument of ``weightroll_begin``: one weight-update session on one replica."""

    update_id: UpdateId
    version: Version
    mode: UpdateMode = UpdateMode.FULL
    #: Required for partial and sparse updates (deltas): the version they were computed
    #: against. A delta on another base would label mixed weights with the new version.
    base_version: Version | None = None
    #: Partial and sparse updates: the update (or trainer push) whose commit produced the
    #: weights the delta builds on; ``null``: the weights the engine booted with. A rank
    #: refuses the delta unless it serves exactly that commit (the version label alone cannot
    #: tell a vLLM restarted onto boot weights from the commit it replaced).
    base_update_id: UpdateId | None = None
    #: Required for partial updates: checkpoint tensor names (or name prefixes ending in ".")
    #: whose modules the update replaces.
    scope: list[str] | None = None

    @model_validator(mode="after")
    def _mode_fields(self) -> Self:
        if self.mode is UpdateMode.FULL and self.base_update_id is not None:
            raise ValueError("baseUpdateId is only allowed when mode is 'partial' or 'sparse'")
        if self.mode is UpdateMode.PARTIAL and not self.scope:
            raise ValueError("scope must list at least one tensor name when mode is 'partial'")
        if self.mode is not UpdateMode.FULL and self.base_version is None:
            raise ValueError(
                f"baseVersion is required when mode is '{self.mode.value}': the version the "
                "delta was computed against"
            )
        if self.mode is UpdateMode.FULL and self.scope:
            raise ValueError("scope is only allowed when mode is 'partial'")
        return self


class LoadSource(WireModel):
    """Argument of ``weightroll_load``: where this rank reads the next batch of tensors.

    For full and partial updates ``path`` is a safetensors file or a directory of them in
    checkpoint format. For sparse updates it is a safetensors file of patch triples (see
    ``engine_agent/reload/sparse.py``).
    """

    path: str = Field(min_length=1)
    #: Optional subset of tensor names to read from ``path``.
    names: list[str] | None = None
    #: Optional manifest (JSON written by ``weightroll manifest``); every byte read is checked
    #: against it before it reaches a live tensor.
    manifest: str | None = None
    #: The update's pin of the manifest's bytes (``source.manifestDigest``): each rank checks
    #: the manifest it reads itself, so one replaced after the agent's check is refused before
    #: any live byte is written.
    manifest_digest: str | None = Field(default=None, pattern=MANIFEST_DIGEST_PATTERN)


class PrefetchArgs(WireModel):
    """Argument of ``weightroll_prefetch``: read the session's checkpoint into host staging
    while the replica still serves (nothing processed, nothing written to live storage)."""

    spec: UpdateSpec
    source: LoadSource
    #: Refuse (``prefetch_memory``) when this rank would stage more bytes than this.
    max_bytes: int | None = Field(default=None, ge=1)


class AbortArgs(WireModel):
    """Argument of ``weightroll_abort``.

    ``poison=True`` is the coordinator's fence: when any rank of a replica wrote live weights in
    a session that will not commit, every rank must be poisoned — including ranks whose own
    session failed before writing (they would otherwise report clean on a mixed replica).
    """

    poison: bool = False
    reason: str | None = None


class RankId(WireModel):
    """Position of a rank in the parallel layout, keyed like vLLM's weight checker."""

    dp: int = Field(ge=0)
    pp: int = Field(ge=0)
    tp: int = Field(ge=0)
    ep: int = Field(default=0, ge=0)

    @property
    def key(self) -> str:
        return f"dp{self.dp}:pp{self.pp}:tp{self.tp}:ep{self.ep}"


class ErrorBody(WireModel):
    """A structured error: a machine-readable ``code``, a ``message`` and the field at fault."""

    code: str
    message: str
    field: str | None = None
    #: On a 409 conflict: the id of the update that is running.
    active_id: str | None = None


class RankStatus(WireModel):
    """Result of ``weightroll_state`` (and the state part of every other call)."""

    rank: RankId
    state: EngineState
    #: Version every weight belongs to when clean; the last committed version otherwise.
    version: str
    update_id: str | None = None
    #: True only when ``state`` is clean: the one condition under which traffic may flow.
    serving_safe: bool
    #: Why the engine is poisoned, if it is.
    poison_reason: str | None = None
    #: The update (or trainer push) whose commit produced the weights this rank serves;
    #: ``None`` for the boot weights, so a restart onto boot weights labelled like the last
    #: commit is seen.
    committed_update_id: str | None = None


class RankReport(WireModel):
    """What one rank says about one call of the extension (begin, load, finish or abort).

    The sidecar commits a replica only when every rank reports ``ok`` and the coverage hashes and
    versions agree (engine-reload.md R7).
    """

    rank: RankId
    call: str
    ok: bool
    state: EngineState
    version: str
    update_id: str | None = None
    error: ErrorBody | None = None
    #: Shard keys this rank must receive in the session.
    required: int = 0
    #: Distinct shard keys received so far.
    received: int = 0
    #: Shard keys still missing (first 50; ``missing_count`` has the total).
    missing: list[str] = Field(default_factory=list)
    missing_count: int = 0
    #: Shard keys that arrived more than once (the duplicate write was refused).
    duplicates: list[str] = Field(default_factory=list)
    #: Modules whose post-load processing ran in this session.
    modules_processed: int = 0
    #: Derived tensors refreshed (e.g. ``model.layers.0.self_attn.attn.W_UK_T``).
    derived_refreshed: list[str] = Field(default_factory=list)
    #: Storage and kernel identity unchanged since begin.
    identity_ok: bool = True
    identity_problems: list[str] = Field(default_factory=list)
    #: SHA-256 over the sorted required shard keys: equal on ranks that agree on the plan
    #: (compared only among ranks of one pipeline stage and expert-parallel rank).
    coverage_hash: str = ""
    #: What this rank received: SHA-256 over the sorted ``name:hash;`` of every checkpoint
    #: tensor of this session, where ``hash`` is the content hash (the manifest's algorithm,
    #: else BLAKE3) of the exact bytes handed to the model's loaders — the checkpoint-layout
    #: input of everything the rank committed (``engine_agent.manifest.rank_digest``). Every
    #: rank reads the whole source, so with a manifest it equals ``Manifest.rank_digest()``
    #: (the sidecar checks that). Sparse updates add ``live:<module>`` entries: the patched
    #: modules' live tensors after the patch (BLAKE3 on CPU, an on-device fingerprint else).
    #: It is not a hash of the kernels' packed live bytes (on CPU linears live in a kernel
    #: closure); those are covered by coverage, processing and the identity check.
    digest: str = ""
    #: ``digest`` without the ``live:`` entries: ``rank_digest`` over the content hashes of the
    #: checkpoint (or pushed) tensors handed to this rank's loaders, nothing else. Every rank of
    #: a replica is handed every tensor of the source (TP, PP and EP ranks drop what they do
    #: not own only after it was hashed), so it must be equal on every rank of the replica; the
    #: sidecar fails the commit ``digest_mismatch`` otherwise (``sidecar/ranks.py``, rule 5).
    source_digest: str = ""
    bytes_loaded: int = 0
    #: Digest of the manifest this rank verified the loaded bytes against ("" when none).
    manifest_digest: str = ""
    #: Seconds spent in each step of the call (read, load, process, refresh, verify, digest).
    timings: dict[str, float] = Field(default_factory=dict)
    #: The rank's prefetch of this update: ``""`` none, ``reading`` (the checkpoint is being read
    #: and hashed into host staging, and what was read routed and post-processed on shadow
    #: modules), ``ready`` (read, verified, prepared, waiting for the drain).
    prefetch: str = ""
    #: Bytes this rank holds (or will hold) in host staging for the prefetch.
    staged_bytes: int = 0


# --------------------------------------------------------------------------------------------
# Sidecar HTTP API
# --------------------------------------------------------------------------------------------


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


# -- the worker extension's RPC names ------------------------------------------------------------


class ExtensionRpc(StrEnum):
    """Every worker-extension method the sidecar calls through vLLM's ``collective_rpc``.

    One name list for both ends: the sidecar passes these to ``/collective_rpc`` and
    ``engine_agent.vllm_extension.WeightRollExtension`` defines a method of each name
    (``tests/unit/engine_agent/test_extension_rpc.py`` holds the two to each other), so a
    renamed method cannot leave the sidecar calling a name no rank answers. Each takes one JSON
    string and returns a :class:`RankReport` dict (:class:`RankStatus` for ``STATE``).
    """

    #: Open an update session (:class:`UpdateSpec`).
    BEGIN = "weightroll_begin"
    #: Load one batch of checkpoint tensors (:class:`LoadSource`).
    LOAD = "weightroll_load"
    #: Start reading the checkpoint into host staging while serving (:class:`PrefetchArgs`).
    PREFETCH = "weightroll_prefetch"
    #: How the rank's prefetch stands (``RankReport.prefetch``; an error ends it).
    PREFETCHED = "weightroll_prefetched"
    #: Load the open session from the prefetched staging (inside the drain).
    APPLY = "weightroll_apply"
    #: Verify and commit the session.
    FINISH = "weightroll_finish"
    #: Abort the session, or fence the rank (:class:`AbortArgs`).
    ABORT = "weightroll_abort"
    #: The rank's :class:`RankStatus`.
    STATE = "weightroll_state"
    #: Whether this rank would accept a trainer's ``init_info`` (native transfer routes).
    TRANSFER_CHECK_INIT = "weightroll_transfer_check_init"
    #: Make the next ``start_weight_update`` open exactly this :class:`UpdateSpec`.
    TRANSFER_ARM = "weightroll_transfer_arm"
    #: Name the version the open pushed session commits as.
    TRANSFER_COMMIT_AS = "weightroll_transfer_commit_as"
    #: This rank's last report of the push.
    TRANSFER_REPORT = "weightroll_transfer_report"
    #: Poison the rank and clear vLLM's update flag (the replica fence for pushes).
    TRANSFER_FENCE = "weightroll_transfer_fence"
