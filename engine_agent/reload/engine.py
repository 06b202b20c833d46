"""One rank's verified reload: begin / load / finish / abort / state.

:class:`RankEngine` glues the pure parts (:mod:`.session` state machine, :mod:`.coverage`
ledger, :mod:`.identity` comparison) to the vLLM-facing :mod:`.modelwise` router. Each public
method returns a report and never raises: an error becomes ``report.error`` with a stable code,
and the state machine decides what the failure means for serving.

Order contracts:
    * ``begin`` computes the required shard set, builds the inventory of everything the kernels
      read (:mod:`.inventory`; a derived item of an updated module with no refresher fails
      here) and snapshots storage and kernel identity before any live byte can change.
    * ``load`` validates the whole batch (source headers, manifest bytes, a dry run of the
      model's loaders over meta tensors, duplicates) before writing; any error ends the session
      (untouched engine: still clean at its old version; touched engine: poisoned).
    * The rank is ``dirty`` before the first kernel-visible change: a module's post-load step,
      a refresher, a kernel swap or a live byte (issue 10, item 3).
    * ``finish`` commits only if coverage is complete with no duplicate, every touched module
      was processed and refreshed, identity is unchanged and every derived item of an updated
      module was rebuilt in this session.

Prefetch (issue 30): ``prefetch`` checks what needs no live state and reads the checkpoint into
host staging on a thread of its own while the rank serves, clean, its guard armed
(:mod:`.prefetch`); ``prefetched`` reports the read; inside the drain, ``begin`` opens the
session and ``apply`` loads it from the staging (the same routing, processing and live writes as
``load``). A failed prefetch, or an abort, frees the staging and leaves the rank as it was.

Failpoints (:mod:`.failpoints`) sit at every step boundary: ``prefetch.read`` (on the reading
thread), ``begin``, ``begin.snapshot``,
``load``, ``load.dry_run``, ``load.staged``, ``post_load.before``, ``post_load.after``,
``refresh.after``, ``copy.before``, ``copy.after``, ``tied.before``, ``tied.after``,
``sparse.before_write``, ``sparse.after_write``, ``finish``, ``finish.coverage``,
``finish.identity``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine_agent.errors import (
    AgentError,
    DerivedStateUnsupported,
    IdentityChanged,
    InvalidRequest,
    ManifestMismatch,
    PrefetchMemory,
    UpdateConflict,
    WrongState,
)
from engine_agent.protocol import (
    AbortArgs,
    ErrorBody,
    LoadSource,
    PrefetchArgs,
    RankId,
    RankReport,
    RankStatus,
    UpdateMode,
    UpdateSpec,
)
from engine_agent.reload import failpoints, session
from engine_agent.reload.coverage import CoverageLedger
from engine_agent.reload.digest import VerifyPool, rank_digest, tensor_digest
from engine_agent.reload.guard import DEFAULT_PERIOD_S, StillTrueGuard, kernel_probes
from engine_agent.reload.identity import StorageRecord, compare_kernels, compare_storage
from engine_agent.reload.index import ModelIndex, build_index
from engine_agent.reload.inventory import Inventory
from engine_agent.reload.modelwise import LoadRouter
from engine_agent.reload.prefetch import Prefetch, available_memory, memory_problem
from engine_agent.reload.processing import ModuleProcessor
from engine_agent.reload.shadow import Prepared, ShadowProcessor, prepare
from engine_agent.reload.sources import open_source

__all__ = ["RankEngine"]

logger = logging.getLogger(__name__)

_MAX_LISTED = 50


class _Session:
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


class RankEngine:
    """The reload state of one vLLM rank.

    Args:
        model: the rank's model (``worker.model_runner.model``).
        device: where its weights live.
        act_dtype: the model's dtype (``model_config.dtype``).
        rank: this rank's position.
        boot_version: the version of the weights the engine started with.
        ranks_on_host: the replica's ranks on this host (vLLM's ``local_world_size``).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        act_dtype: torch.dtype,
        rank: RankId,
        boot_version: str,
        guard_period: float = DEFAULT_PERIOD_S,
        ranks_on_host: int = 1,
    ) -> None:
        self.model = model
        #: Ranks of this replica on this host (they prefetch at once: the memory bound).
        self.ranks_on_host = ranks_on_host
        self.device = device
        self.act_dtype = act_dtype
        self.rank = rank
        self.state = session.initial(boot_version)
        self._index: ModelIndex | None = None
        self._session: _Session | None = None
        #: The update whose checkpoint this rank reads or holds in host staging (``prefetch``
        #: up to ``apply``); kept outside the session, so the rank serves and its guard checks
        #: meanwhile.
        self._prefetch: Prefetch | None = None
        #: "Still true now": sealed at each commit (and for the boot weights at the first state
        #: answer), re-checked on every state answer (:mod:`.guard`).
        self.guard = StillTrueGuard(
            tensors=lambda: self.index.kernel_visible(),
            kernels=lambda: self.index.kernel_snapshot(),
            observations=lambda known: kernel_probes(self.model, known),
            period=guard_period,
        )

    # -- public calls (one per RPC) --------------------------------------------------------

    def begin(self, spec_json: str) -> dict[str, Any]:
        return self._call("begin", lambda: self._begin(_parse(UpdateSpec, spec_json, "spec")))

    def load(self, source_json: str) -> dict[str, Any]:
        return self._call("load", lambda: self._load(_parse(LoadSource, source_json, "source")))

    def prefetch(self, args_json: str) -> dict[str, Any]:
        """Start reading an update's checkpoint into host staging while the rank serves
        (:mod:`.prefetch`); returns at once, the read goes on in a thread of its own."""
        return self._call(
            "prefetch", lambda: self._prefetch_start(_parse(PrefetchArgs, args_json, "args"))
        )

    def prefetched(self, _args_json: str = "{}") -> dict[str, Any]:
        """How the prefetch stands (``RankReport.prefetch``); a failed read ends it."""
        return self._call("prefetched", self._prefetch_poll)

    def apply(self, _args_json: str = "{}") -> dict[str, Any]:
        """Load the open session from its prefetched staging (inside the drain): the same
        routing, processing and live writes as :meth:`load`, without the read."""
        return self._call("apply", self._apply)

    def load_tensors(self, weights: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Load one batch of tensors received over a transport (the trainer path).

        The same checks as :meth:`load` minus the file-only ones: a dry run of the whole batch
        (names, shapes, dtypes, duplicates) before any byte is written, then the per-shard
        ledger, staging, processing and derived-state refresh. Sparse sessions are refused.
        """
        return self._call("load", lambda: self._load_tensors(weights))

    def retarget(self, version: str) -> dict[str, Any]:
        """Name the version the open session commits as (a trainer names it only at finish)."""
        return self._call("retarget", lambda: self._retarget(version))

    def finish(self, _args_json: str = "{}") -> dict[str, Any]:
        return self._call("finish", self._finish)

    def abort(self, args_json: str = "{}") -> dict[str, Any]:
        return self._call("abort", lambda: self._abort(_parse(AbortArgs, args_json, "args")))

    def status(self) -> dict[str, Any]:
        self._check_still_true()
        return RankStatus(
            rank=self.rank,
            state=self.state.state,
            version=self.state.version,
            update_id=self.state.update_id,
            serving_safe=self.state.serving_safe,
            poison_reason=self.state.poison_reason,
            committed_update_id=self.state.committed_by,
        ).to_wire()

    # -- implementation ------------------------------------------------------------------

    def _check_still_true(self, *, force_content: bool = False) -> None:
        """Poison the rank if what its kernels read is no longer what it committed.

        Only a clean rank outside a session claims anything; one that was never sealed (the boot
        weights, or a session aborted before any write) is sealed now. A guard that cannot check
        fails closed.
        """
        if not self.state.serving_safe or self._session is not None:
            return
        try:
            if not self.guard.sealed:
                self.guard.seal()
                return
            problems = self.guard.violations(force_content=force_content)
        except Exception as e:  # fail closed: an unknown state is not a clean one
            logger.exception("Still-true check failed on rank %s", self.rank.key)
            problems = [f"the check itself failed ({type(e).__name__})"]
        if problems:
            reason = StillTrueGuard.describe(problems)
            logger.error("Rank %s no longer serves its commit: %s", self.rank.key, reason)
            self.state = session.poison(self.state, reason)
            self.guard.unseal()

    def _call(self, call: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            failpoints.check(call, self.rank)
            return body()
        except AgentError as e:
            logger.warning("Weight update %s failed on rank %s: %s", call, self.rank.key, e.message)
            return self._failed(call, e, ends_session=call in ("load", "apply", "finish"))
        except Exception as e:  # an engine bug must still leave the rank fail-closed
            logger.exception("Weight update %s crashed on rank %s", call, self.rank.key)
            return self._failed(call, AgentError(f"{type(e).__name__}: {e}"), ends_session=True)
        finally:
            if self._session is not None:
                self._session.timings[call] = round(time.perf_counter() - started, 6)

    def _failed(self, call: str, error: AgentError, *, ends_session: bool) -> dict[str, Any]:
        if call in ("prefetch", "prefetched"):
            # Nothing was written: the staging is freed and the rank serves on, clean.
            staged = self._prefetch
            self._drop_prefetch()
            return self._prefetch_report(call, staged, ok=False, error=error)
        fields = self._progress_fields()
        if ends_session and self.state.in_session:
            self.state = session.fail(self.state, f"{call} failed: {error.message}")
            if self._session is not None:
                self._session.router.discard()
            self._session = None
            self._drop_prefetch()
        return self._report(call, ok=False, error=error, fields=fields)

    @property
    def index(self) -> ModelIndex:
        if self._index is None:
            self._index = build_index(self.model)
        return self._index

    def _refuse_model_level_hook(self) -> None:
        """Refuse a model whose post-load step runs over the whole model: it cannot be replayed
        module by module, so neither a session nor a prefetch may start on it."""
        if callable(getattr(self.model, "process_weights_after_loading", None)):
            raise WrongState(
                f"{type(self.model).__name__} has a model-level post-load hook that cannot be "
                "replayed per module; in-place updates are refused for this model"
            )

    def _begin(self, spec: UpdateSpec) -> dict[str, Any]:
        if self.state.in_session:
            # A retried begin of the open session (same id, same spec) is acknowledged; any
            # other begin, a same id with another spec included, is a conflict (issue 26, 8).
            session.begin(self.state, spec)
            return self._report("begin", ok=True)
        self._refuse_model_level_hook()
        if spec.mode is not UpdateMode.FULL:
            # A delta builds on the live bytes: they must still be the commit it names.
            self._check_still_true(force_content=True)
        self.guard.unseal()
        new_state = session.begin(self.state, spec)
        active = self._new_session(spec)
        failpoints.check("begin.snapshot", self.rank)
        self._session = active
        self.state = new_state
        logger.info(
            "Began weight update %s on rank %s: %d shards required",
            spec.update_id,
            self.rank.key,
            active.ledger.required_count,
        )
        return self._report("begin", ok=True)

    def _new_session(
        self, spec: UpdateSpec, processor: type[ModuleProcessor] = ModuleProcessor
    ) -> _Session:
        """What a session of ``spec`` keeps: required shards, inventory, router and identity
        snapshots. Changes no state (a prefetch builds one for its dry run only).

        Raises:
            DerivedStateUnsupported: a required module has derived state with no refresher.
        """
        index = self.index
        if spec.mode is UpdateMode.PARTIAL:
            assert spec.scope is not None
            modules = index.resolve_scope(spec.scope)
            required = index.required(modules)
        elif spec.mode is UpdateMode.FULL:
            required = index.required()
        else:
            required = {}  # sparse: the patch declares what it changes (see _load_sparse)
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
            index,
            ledger,
            self.device,
            self.act_dtype,
            self._mark_written,
            inventory,
            lambda point: failpoints.check(point, self.rank),
            processor,
        )
        return _Session(
            spec, ledger, router, index.storage_snapshot(), index.kernel_snapshot(), inventory
        )

    def _mark_written(self) -> None:
        active = self._session
        if active is not None and active.before_first_write is not None:
            active.before_first_write()
        self.state = session.mark_written(self.state)

    def _require_session(self) -> _Session:
        if self._session is None or not self.state.in_session:
            raise WrongState(
                f"no update session is open (engine is {self.state.state.value}); call begin first"
            )
        return self._session

    def _open_checkpoint(self, source: LoadSource, spec: UpdateSpec) -> Any:
        """Read ``source``'s manifest (checked against the pin and ``spec``) and open its files:
        headers are checked against the manifest here; content hashes on the very bytes the
        loaders consume, while they consume them (sources.py): one read, no window."""
        manifest = None
        if source.manifest is not None:
            from engine_agent.manifest import ManifestError, load_manifest

            try:
                manifest = load_manifest(source.manifest, pinned=source.manifest_digest)
            except (ManifestError, OSError) as e:
                raise ManifestMismatch(f"manifest {source.manifest}: {e}", field="manifest") from e
            _check_manifest_versions(manifest, spec, source.manifest)
        return open_source(source.path, source.names, manifest)

    def _load(self, source: LoadSource) -> dict[str, Any]:
        active = self._require_session()
        with _timed(active.timings, "read_headers"):
            checkpoint = self._open_checkpoint(source, active.spec)
        if active.spec.mode is UpdateMode.SPARSE:
            return self._load_sparse(active, checkpoint)
        with _timed(active.timings, "dry_run"):
            active.router.dry_run(
                (info.name, info.shape, info.dtype) for info in checkpoint.infos.values()
            )
        failpoints.check("load.dry_run", self.rank)
        active.before_first_write = checkpoint.verified_so_far
        with _timed(active.timings, "load"):
            active.router.load(checkpoint.tensors())
            checkpoint.complete()
        failpoints.check("load.read", self.rank)
        self._loaded(active, checkpoint)
        return self._report("load", ok=True)

    @staticmethod
    def _loaded(active: _Session, checkpoint: Any, *, prefix: str = "") -> None:
        """Record a batch whose every byte was hashed (and verified, with a manifest); its
        hashing times under ``prefix`` (``prefetch_``: they were spent before the drain)."""
        active.source_hashes |= checkpoint.content_hashes
        if checkpoint.manifest is not None:
            active.manifest_digest = checkpoint.manifest.digest
        for step, seconds in (
            (prefix + "hash_overlapped", checkpoint.hash_seconds),
            (prefix + "hash_wait", checkpoint.hash_wait_seconds),
        ):
            active.timings[step] = round(active.timings.get(step, 0.0) + seconds, 6)

    def _load_tensors(self, weights: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        active = self._require_session()
        if active.spec.mode is UpdateMode.SPARSE:
            raise InvalidRequest("sparse updates are loaded from a patch file", field="mode")
        with _timed(active.timings, "dry_run"):
            active.router.dry_run((name, tensor.shape, tensor.dtype) for name, tensor in weights)
        # Pushed tensors enter the rank digest like checkpoint tensors do (their content hash).
        # Host tensors are hashed by worker threads while the loaders consume them, as file
        # loads are (BLAKE3 releases the GIL); a tensor on an accelerator is fingerprinted on
        # its own device, in this thread (its stream order is the loaders').
        hashes: dict[str, str] = {}
        pool = VerifyPool("blake3")

        def record(name: str, digest: str) -> None:
            hashes[name] = "blake3:" + digest

        def handed_out() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if tensor.device.type == "cpu":
                    pool.submit(name, tensor, record)
                yield name, tensor

        try:
            with _timed(active.timings, "load"):
                active.router.load(handed_out())
            with _timed(active.timings, "hash_wait"):
                pool.drain()
                for name, tensor in weights:
                    if tensor.device.type != "cpu":
                        hashes[name] = tensor_digest(tensor)
        finally:
            pool.close()
        active.timings["hash_overlapped"] = round(
            active.timings.get("hash_overlapped", 0.0) + pool.hash_seconds, 6
        )
        active.source_hashes |= hashes
        return self._report("load", ok=True)

    # -- prefetch (issue 30) --------------------------------------------------------------

    def _prefetch_start(self, args: PrefetchArgs) -> dict[str, Any]:
        """Check everything that needs no live state, then start the read (module
        :mod:`.prefetch`). The rank stays clean at its version, serving, its guard armed."""
        spec = args.spec
        if self._prefetch is not None and self._prefetch.spec == spec:
            return self._prefetch_report("prefetch", self._prefetch, ok=True)  # a retried call
        prefetched = session.prefetch(self.state, spec)
        self._refuse_model_level_hook()
        started = time.perf_counter()
        checkpoint = self._open_checkpoint(args.source, spec)
        stage_bytes = sum(info.nbytes for info in checkpoint.infos.values())
        refused = memory_problem(
            stage_bytes, args.max_bytes, available_memory(), self.ranks_on_host
        )
        if refused is not None:
            raise PrefetchMemory(refused, field="prefetch.maxBytes")
        # Names, shapes, dtypes, shard keys, duplicates and per-shard coverage, over meta
        # tensors: the model's loaders run with proxies installed, inside this call (the engine
        # does not step meanwhile), and nothing is staged or recorded for the real session.
        probe = self._new_session(spec)
        keys = probe.router.dry_run(
            (info.name, info.shape, info.dtype) for info in checkpoint.infos.values()
        )
        for key in keys:
            probe.ledger.record(key)
        probe.ledger.require_complete()
        staging = Prefetch(
            spec, checkpoint, stage_bytes, lambda point: failpoints.check(point, self.rank)
        )
        staging.timings["prefetch_check"] = round(time.perf_counter() - started, 6)
        self._prefetch, self.state = staging, prefetched
        staging.start()
        logger.info(
            "Started prefetch of %s on rank %s: %d bytes to stage, %d shards",
            spec.update_id,
            self.rank.key,
            stage_bytes,
            probe.ledger.required_count,
        )
        return self._prefetch_report("prefetch", staging, ok=True)

    def _prefetch_poll(self) -> dict[str, Any]:
        staging = self._current_prefetch()
        if staging is None:
            raise WrongState("no prefetch is held on this rank (aborted, or the rank restarted)")
        if staging.error is not None:
            raise staging.error
        if staging.prepared is None:
            self._prepare(staging)  # this call runs between engine steps, as the dry run did
        return self._prefetch_report("prefetched", staging, ok=True)

    def _current_prefetch(self) -> Prefetch | None:
        """The prefetch the state still names (a poisoned rank, say, names none: dropped)."""
        if self._prefetch is not None and self.state.prefetched != self._prefetch.spec.update_id:
            self._drop_prefetch()
        return self._prefetch

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            self._prefetch = None
        self.state = session.drop_prefetch(self.state)

    def _apply(self) -> dict[str, Any]:
        active = self._require_session()
        staging = self._current_prefetch()
        if staging is None or staging.status != "ready":
            state = "none" if staging is None else staging.status
            raise WrongState(
                f"update {active.spec.update_id} has no prefetched checkpoint ready on this "
                f"rank (prefetch: {state}); load it instead",
                field="prefetch",
            )
        if staging.spec != active.spec:
            raise UpdateConflict(
                f"the prefetched checkpoint was read for another spec of update "
                f"{active.spec.update_id}; abort and send it again",
                field="prefetch",
            )
        self._prefetch, self.state = None, session.drop_prefetch(self.state)
        # Routed and post-processed on shadows while the rank served (the poll that found the
        # read done); a caller that skipped that poll pays for it here, inside the drain.
        prepared = staging.prepared
        while prepared is None:  # the read is ready: each step prepares more, the last finishes
            prepared = self._prepare(staging)
        staging.prepared = None
        with _timed(active.timings, "load"):
            prepared.apply(active.router.processing, lambda p: failpoints.check(p, self.rank))
        active.router.bytes_loaded += prepared.bytes_loaded
        active.sealed_digests = prepared.digests
        failpoints.check("load.read", self.rank)
        self._loaded(active, staging.checkpoint, prefix="prefetch_")
        active.timings |= staging.timings
        return self._report("apply", ok=True)

    def _prepare(self, staging: Prefetch) -> Prepared | None:
        """One preparation step of ``staging`` (:func:`.shadow.prepare`), inside this RPC."""
        return prepare(staging, lambda: self._new_session(staging.spec, ShadowProcessor))

    def _prefetch_report(
        self,
        call: str,
        staging: Prefetch | None,
        *,
        ok: bool,
        error: AgentError | None = None,
    ) -> dict[str, Any]:
        return self._wire_report(
            call,
            ok=ok,
            error=error,
            update_id=None if staging is None else staging.spec.update_id,
            # ``ready`` once prepared: a read that ended after this call's preparation step is
            # prepared by the next poll, not inside the drain
            prefetch=""
            if staging is None or not ok
            else "ready"
            if staging.prepared is not None
            else "reading",
            staged_bytes=0 if staging is None else staging.stage_bytes,
            timings={} if staging is None else dict(staging.timings),
        )

    def _retarget(self, version: str) -> dict[str, Any]:
        active = self._require_session()
        spec = _parse(
            UpdateSpec,
            active.spec.model_copy(update={"version": version}).model_dump_json(by_alias=True),
            "version",
        )
        active.spec = spec
        self.state = replace(self.state, target_version=spec.version)
        return self._report("retarget", ok=True)

    def _load_sparse(self, active: _Session, checkpoint: Any) -> dict[str, Any]:
        from engine_agent.reload.sparse import read_patches

        base = checkpoint.metadata.get("weightroll.base_version")
        if base != active.spec.base_version:
            raise InvalidRequest(
                f"patch is based on {base!r} but the update declares baseVersion "
                f"{active.spec.base_version!r}",
                field="base_version",
            )
        patches = read_patches(checkpoint)
        checkpoint.complete()
        failpoints.check("load.read", self.rank)
        self._loaded(active, checkpoint)
        with _timed(active.timings, "load"):
            active.router.apply_sparse(patches)
        return self._report("load", ok=True)

    def _finish(self) -> dict[str, Any]:
        active = self._require_session()
        ledger, router = active.ledger, active.router
        with _timed(active.timings, "coverage"):
            ledger.require_complete()
            unprocessed = sorted(ledger.touched() - router.processed)
            if unprocessed:
                raise IdentityChanged(
                    f"modules received weights but were not processed: {unprocessed}"
                )
            if ledger.received_count == 0:
                raise WrongState("no weights were loaded in this session; nothing to commit")
        failpoints.check("finish.coverage", self.rank)
        with _timed(active.timings, "identity"):
            problems = compare_storage(active.storage, self.index.storage_snapshot())
            problems += compare_kernels(active.kernels, self.index.kernel_snapshot())
            problems += active.inventory.compare(self.model, set(ledger.touched()), router.rebuilt)
            if problems:
                raise IdentityChanged(
                    f"{len(problems)} kernel-visible tensor(s) or kernel(s) changed: "
                    + "; ".join(problems[:5])
                )
        failpoints.check("finish.identity", self.rank)
        committed = session.commit(self.state)
        report = RankReport(
            rank=self.rank,
            call="finish",
            ok=True,
            state=committed.state,
            version=committed.version,
            update_id=active.spec.update_id,
            **self._progress_fields(),
        ).to_wire()
        self.state, self._session = committed, None
        try:
            # what "still true now" is checked against from here on
            self.guard.seal(active.sealed_digests)
        except Exception as e:  # a commit that cannot be guarded is not served
            self.state = session.poison(self.state, f"the commit could not be sealed: {e!r:.200}")
            raise
        logger.info(
            "Committed weight update on rank %s: version %s", self.rank.key, committed.version
        )
        return report

    def _abort(self, args: AbortArgs) -> dict[str, Any]:
        fields = self._progress_fields()
        self._drop_prefetch()  # staging of an update that will not be applied: just freed
        if args.poison:
            # The coordinator saw another rank of this replica write: the replica is mixed even
            # if this rank's own bytes are intact.
            self.state = session.poison(self.state, args.reason or "poisoned by the coordinator")
        elif self._session is None or not self.state.in_session:
            return self._report("abort", ok=True)
        else:
            self.state = session.abort(self.state)
        if self._session is None:
            return self._report("abort", ok=True, fields=fields)
        self._session.router.discard()
        self._session = None
        return self._report("abort", ok=True, fields=fields)

    # -- reports -------------------------------------------------------------------------

    def _progress_fields(self) -> dict[str, Any]:
        active = self._session
        if active is None:
            return {}
        ledger, router = active.ledger, active.router
        missing = ledger.missing()
        digests = router.module_digests
        return {
            "required": ledger.required_count,
            "received": ledger.received_count,
            "missing": [str(k) for k in missing[:_MAX_LISTED]],
            "missing_count": len(missing),
            "duplicates": [str(k) for k in ledger.duplicates[:_MAX_LISTED]],
            "modules_processed": len(router.processed),
            "derived_refreshed": router.derived_refreshed[:_MAX_LISTED],
            "coverage_hash": ledger.received_hash()
            if active.spec.mode is UpdateMode.SPARSE
            else ledger.required_hash(),
            "digest": rank_digest(
                active.source_hashes | {f"live:{m}": d for m, d in digests.items()}
            ),
            "source_digest": rank_digest(active.source_hashes),
            "bytes_loaded": router.bytes_loaded,
            "manifest_digest": active.manifest_digest,
            "timings": active.timings | {k: round(v, 6) for k, v in router.timings.items()},
        }

    def _report(
        self,
        call: str,
        *,
        ok: bool,
        error: AgentError | None = None,
        fields: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        fields = self._progress_fields() if fields is None else fields
        identity_problems = [error.message] if isinstance(error, IdentityChanged) else []
        return self._wire_report(
            call,
            ok=ok,
            error=error,
            update_id=self.state.update_id,
            identity_ok=not identity_problems,
            identity_problems=identity_problems,
            **fields,
        )

    def _wire_report(
        self, call: str, *, ok: bool, error: AgentError | None, update_id: str | None, **fields: Any
    ) -> dict[str, Any]:
        """The rank's answer to ``call``: who it is, its state and version, the error if any,
        and the call's own ``fields`` (a session's progress, or a prefetch's staging)."""
        return RankReport(
            rank=self.rank,
            call=call,
            ok=ok,
            state=self.state.state,
            version=self.state.version,
            update_id=update_id,
            error=None
            if error is None
            else ErrorBody(code=error.code, message=error.message, field=error.field),
            **fields,
        ).to_wire()


def _check_manifest_versions(manifest: Any, spec: UpdateSpec, path: str) -> None:
    """Refuse a manifest written for another version (or, for a sparse patch, another base).

    The agent checks this too; the rank checks it again on the manifest it read itself, so a
    caller that skips the agent (or a manifest replaced after the agent read it, when no digest
    pins it) cannot commit bytes under a version their manifest does not name.

    Raises:
        ManifestMismatch: naming both versions.
    """
    if manifest.version is not None and manifest.version != spec.version:
        raise ManifestMismatch(
            f"manifest {path} is for version {manifest.version!r} but this update commits "
            f"{spec.version!r}; nothing was loaded",
            field="manifest",
        )
    if spec.mode is UpdateMode.SPARSE and manifest.base_version != spec.base_version:
        raise ManifestMismatch(
            f"manifest {path} applies to base version {manifest.base_version!r} but this "
            f"update declares baseVersion {spec.base_version!r}; nothing was loaded",
            field="manifest",
        )


def _parse(model: Any, raw: str, field: str) -> Any:
    from pydantic import ValidationError

    try:
        return model.model_validate_json(raw or "{}")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or field
        raise InvalidRequest(
            f"{field}.{where}: {first.get('msg')}", field=f"{field}.{where}"
        ) from e


@contextmanager
def _timed(timings: dict[str, float], step: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[step] = round(timings.get(step, 0.0) + time.perf_counter() - started, 6)
