"""The worker extension's side of the wire: what the sidecar sends each rank through vLLM's
``collective_rpc`` (:class:`UpdateSpec`, :class:`LoadSource`, :class:`PrefetchArgs`,
:class:`AbortArgs`), what each rank answers (:class:`RankReport`, :class:`RankStatus`), and the
one list of method names (:class:`ExtensionRpc`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

from engine_agent.protocol.wire import (
    MANIFEST_DIGEST_PATTERN,
    UpdateId,
    Version,
    WireModel,
)


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
    #: sidecar fails the commit ``digest_mismatch`` otherwise (``sidecar/agreement.py``, rule 5).
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
