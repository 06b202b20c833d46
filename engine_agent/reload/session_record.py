"""The session record: what one open update keeps on one rank, and how the rank reports it.

A :class:`SessionRecord` lives from ``begin`` to the commit or the end of the session (a
prefetch also builds one, for its dry run and its shadows, never for the real session). It holds
the spec, the coverage ledger, the load router, the identity snapshots taken before any live
byte could change, the inventory, and what the session measured: the content hashes of the
bytes the loaders consumed, the manifest they were verified against, and per-step timings.

:func:`open_record` builds one and changes nothing (a derived item of a required module with no
refresher is refused here). :meth:`SessionRecord.progress_fields` and :func:`wire_report` turn
the record and the rank's state into the ``RankReport`` every call answers with; the state
machine itself (:mod:`.session`) and the order of the calls (:mod:`.engine`) live elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine_agent.errors import AgentError, DerivedStateUnsupported
from engine_agent.protocol import ErrorBody, RankId, RankReport, UpdateMode, UpdateSpec
from engine_agent.reload.coverage import CoverageLedger
from engine_agent.reload.digest import rank_digest
from engine_agent.reload.identity import StorageRecord
from engine_agent.reload.index import ModelIndex
from engine_agent.reload.inventory import Inventory
from engine_agent.reload.modelwise import LoadRouter
from engine_agent.reload.processing import ModuleProcessor
from engine_agent.reload.session import WeightState

__all__ = ["MAX_LISTED", "SessionRecord", "open_record", "timed", "wire_report"]

#: How many missing or duplicate shards and refreshed derived items a report lists (the counts
#: are always whole).
MAX_LISTED = 50


class SessionRecord:
    """Everything one open update keeps on one rank."""

    def __init__(
        self,
        spec: UpdateSpec,
        ledger: CoverageLedger,
        router: LoadRouter,
        storage: dict[str, StorageRecord],
        kernels: dict[str, str],
        inventory: Inventory,
    ) -> None:
        self.spec = spec
        self.ledger = ledger
        self.router = router
        self.storage = storage
        self.kernels = kernels
        self.inventory = inventory
        self.timings: dict[str, float] = {}
        #: Digest of the manifest the last load was verified against.
        self.manifest_digest = ""
        #: Checkpoint tensor name -> content hash of the bytes this rank's loaders consumed.
        self.source_hashes: dict[str, str] = {}
        #: Runs right before the session's first live write: waits for the hashes of every
        #: tensor handed out so far, so a wrong checkpoint is refused with the rank still clean.
        self.before_first_write: Callable[[], None] | None = None
        #: Digests the commit's seal takes as known (a prefetched update's, :mod:`.shadow`).
        self.sealed_digests: dict[str, str] = {}

    def loaded(self, checkpoint: Any, *, prefix: str = "") -> None:
        """Record a batch whose every byte was hashed (and verified, with a manifest); its
        hashing times under ``prefix`` (``prefetch_``: they were spent before the drain)."""
        self.source_hashes |= checkpoint.content_hashes
        if checkpoint.manifest is not None:
            self.manifest_digest = checkpoint.manifest.digest
        for step, seconds in (
            (prefix + "hash_overlapped", checkpoint.hash_seconds),
            (prefix + "hash_wait", checkpoint.hash_wait_seconds),
        ):
            self.timings[step] = round(self.timings.get(step, 0.0) + seconds, 6)

    def progress_fields(self) -> dict[str, Any]:
        """The session's progress as ``RankReport`` fields: coverage, digests, timings."""
        ledger, router = self.ledger, self.router
        missing = ledger.missing()
        digests = router.module_digests
        return {
            "required": ledger.required_count,
            "received": ledger.received_count,
            "missing": [str(k) for k in missing[:MAX_LISTED]],
            "missing_count": len(missing),
            "duplicates": [str(k) for k in ledger.duplicates[:MAX_LISTED]],
            "modules_processed": len(router.processed),
            "derived_refreshed": router.derived_refreshed[:MAX_LISTED],
            "coverage_hash": ledger.received_hash()
            if self.spec.mode is UpdateMode.SPARSE
            else ledger.required_hash(),
            "digest": rank_digest(
                self.source_hashes | {f"live:{m}": d for m, d in digests.items()}
            ),
            "source_digest": rank_digest(self.source_hashes),
            "bytes_loaded": router.bytes_loaded,
            "manifest_digest": self.manifest_digest,
            "timings": self.timings | {k: round(v, 6) for k, v in router.timings.items()},
        }


def open_record(
    index: ModelIndex,
    spec: UpdateSpec,
    device: torch.device,
    act_dtype: torch.dtype,
    mark_written: Callable[[], None],
    failpoint: Callable[[str], None],
    processor: type[ModuleProcessor] = ModuleProcessor,
) -> SessionRecord:
    """What a session of ``spec`` keeps: required shards, inventory, router and identity
    snapshots. Changes no state (a prefetch builds one for its dry run only).

    Args:
        index: the rank's model index.
        spec: the update.
        device: where the rank's weights live.
        act_dtype: the model's dtype.
        mark_written: called by the router before each kernel-visible change.
        failpoint: fires a named failpoint on this rank (:mod:`.failpoints`).
        processor: the post-load processing (:class:`~.shadow.ShadowProcessor` for a prefetch).

    Raises:
        DerivedStateUnsupported: a required module has derived state with no refresher.
    """
    if spec.mode is UpdateMode.PARTIAL:
        assert spec.scope is not None
        modules = index.resolve_scope(spec.scope)
        required = index.required(modules)
    elif spec.mode is UpdateMode.FULL:
        required = index.required()
    else:
        required = {}  # sparse: the patch declares what it changes (RankEngine._load_sparse)
    optional = (
        frozenset((e.name, p) for e in index.entries.values() for p in e.templates)
        if spec.mode is UpdateMode.SPARSE
        else frozenset()
    )
    blocked = sorted(set(required) & index.unsupported.keys())
    if blocked:
        raise DerivedStateUnsupported(
            f"{blocked[0]}: {index.unsupported[blocked[0]]}; updating it would leave that "
            "derived state stale",
            field="scope",
        )
    inventory = index.inventory()
    stale = inventory.unsupported(required)
    if stale:
        raise DerivedStateUnsupported(
            f"{stale[0].module}: attribute {stale[0].name.removeprefix(stale[0].module + '.')}"
            f" is derived from {sorted(stale[0].sources)} and weightroll has no refresher "
            "for it; updating its sources would leave it stale",
            field=stale[0].name,
        )
    ledger = CoverageLedger(required, optional)
    router = LoadRouter(
        index, ledger, device, act_dtype, mark_written, inventory, failpoint, processor
    )
    return SessionRecord(
        spec, ledger, router, index.storage_snapshot(), index.kernel_snapshot(), inventory
    )


def wire_report(
    rank: RankId,
    ws: WeightState,
    call: str,
    *,
    ok: bool,
    error: AgentError | None,
    update_id: str | None,
    **fields: Any,
) -> dict[str, Any]:
    """The rank's answer to ``call``: who it is, its state and version, the error if any,
    and the call's own ``fields`` (a session's progress, or a prefetch's staging)."""
    return RankReport(
        rank=rank,
        call=call,
        ok=ok,
        state=ws.state,
        version=ws.version,
        update_id=update_id,
        error=None
        if error is None
        else ErrorBody(code=error.code, message=error.message, field=error.field),
        **fields,
    ).to_wire()


@contextmanager
def timed(timings: dict[str, float], step: str) -> Iterator[None]:
    """Add the time the block takes to ``timings[step]`` (summed over calls)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[step] = round(timings.get(step, 0.0) + time.perf_counter() - started, 6)
