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

Prefetch (issue 30): the calls ``prefetch``, ``prefetched`` and ``apply`` are dispatched here and
run in :mod:`.rank_prefetch`, the base class that holds the staging outside the session. The
session record, its progress and the wire report are :mod:`.session_record`.

Failpoints (:mod:`.failpoints`) sit at every step boundary: ``prefetch.read`` (on the reading
thread), ``prefetch.post_load``, ``prefetch.seal_digest`` (on the seal's digest thread),
``begin``, ``begin.snapshot``, ``load``, ``load.dry_run``, ``load.staged``,
``post_load.before``, ``post_load.after``, ``refresh.after``, ``copy.before``, ``copy.after``,
``tied.before``, ``tied.after``, ``sparse.before_write``, ``sparse.after_write``, ``finish``,
``finish.coverage``, ``finish.identity``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine_agent.errors import AgentError, IdentityChanged, InvalidRequest, WrongState
from engine_agent.protocol import (
    AbortArgs,
    LoadSource,
    PrefetchArgs,
    RankId,
    RankReport,
    RankStatus,
    UpdateMode,
    UpdateSpec,
)
from engine_agent.reload import failpoints, session
from engine_agent.reload.digest import load_hashing
from engine_agent.reload.guard import DEFAULT_PERIOD_S, StillTrueGuard, kernel_probes
from engine_agent.reload.identity import compare_kernels, compare_storage
from engine_agent.reload.index import ModelIndex, build_index
from engine_agent.reload.prefetch import Prefetch
from engine_agent.reload.processing import ModuleProcessor
from engine_agent.reload.rank_prefetch import RankPrefetch
from engine_agent.reload.session_record import SessionRecord, open_record, timed, wire_report
from engine_agent.reload.sources import open_checkpoint

__all__ = ["RankEngine"]

logger = logging.getLogger(__name__)


class RankEngine(RankPrefetch):
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
        self.ranks_on_host = ranks_on_host
        self.device = device
        self.act_dtype = act_dtype
        self.rank = rank
        self.state = session.initial(boot_version)
        self._index: ModelIndex | None = None
        self._session: SessionRecord | None = None
        self._prefetch: Prefetch | None = None  # the staging (RankPrefetch), outside the session
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
    ) -> SessionRecord:
        """A record for a session of ``spec`` (:func:`.session_record.open_record`); changes no
        state (a prefetch builds one for its dry run and its shadows only).

        Raises:
            DerivedStateUnsupported: a required module has derived state with no refresher.
        """
        return open_record(
            self.index,
            spec,
            self.device,
            self.act_dtype,
            self._mark_written,
            lambda point: failpoints.check(point, self.rank),
            processor,
        )

    def _mark_written(self) -> None:
        active = self._session
        if active is not None and active.before_first_write is not None:
            active.before_first_write()
        self.state = session.mark_written(self.state)

    def _require_session(self) -> SessionRecord:
        if self._session is None or not self.state.in_session:
            raise WrongState(
                f"no update session is open (engine is {self.state.state.value}); call begin first"
            )
        return self._session

    def _load(self, source: LoadSource) -> dict[str, Any]:
        active = self._require_session()
        with timed(active.timings, "read_headers"):
            checkpoint = open_checkpoint(source, active.spec)
        if active.spec.mode is UpdateMode.SPARSE:
            return self._load_sparse(active, checkpoint)
        with timed(active.timings, "dry_run"):
            active.router.dry_run(
                (info.name, info.shape, info.dtype) for info in checkpoint.infos.values()
            )
        failpoints.check("load.dry_run", self.rank)
        active.before_first_write = checkpoint.verified_so_far
        with timed(active.timings, "load"):
            active.router.load(checkpoint.tensors())
            checkpoint.complete()
        failpoints.check("load.read", self.rank)
        active.loaded(checkpoint)
        return self._report("load", ok=True)

    def _load_tensors(self, weights: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        active = self._require_session()
        if active.spec.mode is UpdateMode.SPARSE:
            raise InvalidRequest("sparse updates are loaded from a patch file", field="mode")
        with timed(active.timings, "dry_run"):
            active.router.dry_run((name, tensor.shape, tensor.dtype) for name, tensor in weights)
        hashes = load_hashing(weights, active.router.load, active.timings)
        active.source_hashes |= hashes
        return self._report("load", ok=True)

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

    def _load_sparse(self, active: SessionRecord, checkpoint: Any) -> dict[str, Any]:
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
        active.loaded(checkpoint)
        with timed(active.timings, "load"):
            active.router.apply_sparse(patches)
        return self._report("load", ok=True)

    def _finish(self) -> dict[str, Any]:
        active = self._require_session()
        ledger, router = active.ledger, active.router
        with timed(active.timings, "coverage"):
            ledger.require_complete()
            unprocessed = sorted(ledger.touched() - router.processed)
            if unprocessed:
                raise IdentityChanged(
                    f"modules received weights but were not processed: {unprocessed}"
                )
            if ledger.received_count == 0:
                raise WrongState("no weights were loaded in this session; nothing to commit")
        failpoints.check("finish.coverage", self.rank)
        with timed(active.timings, "identity"):
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
        return {} if self._session is None else self._session.progress_fields()

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
        return wire_report(
            self.rank,
            self.state,
            call,
            ok=ok,
            error=error,
            update_id=self.state.update_id,
            identity_ok=not identity_problems,
            identity_problems=identity_problems,
            **fields,
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
