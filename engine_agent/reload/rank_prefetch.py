"""The prefetch half of one rank's reload (issue 30): start, poll, prepare, apply, report.

``prefetch`` checks what needs no live state and reads the checkpoint into host staging on a
thread of its own while the rank serves, clean, its guard armed (:mod:`.prefetch`);
``prefetched`` reports the read and, between engine steps, prepares what was read on shadow
modules (:mod:`.shadow`); inside the drain, ``begin`` opens the session and ``apply`` loads it
from the staging (the same routing, processing and live writes as ``load``). A failed prefetch,
or an abort, frees the staging and leaves the rank as it was.

:class:`RankPrefetch` is a base of :class:`~engine_agent.reload.engine.RankEngine`, which
keeps the dispatch and the session core (begin/load/finish/abort): the staging is held outside
the session on purpose, so the rank serves and its guard checks meanwhile. What this half needs
of the core is declared here as abstract methods, so the two halves import one way only.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from engine_agent.errors import AgentError, PrefetchMemory, UpdateConflict, WrongState
from engine_agent.protocol import PrefetchArgs, RankId, UpdateSpec
from engine_agent.reload import failpoints, session
from engine_agent.reload.prefetch import Prefetch, available_memory, memory_problem
from engine_agent.reload.processing import ModuleProcessor
from engine_agent.reload.session_record import SessionRecord, timed, wire_report
from engine_agent.reload.shadow import Prepared, ShadowProcessor, prepare
from engine_agent.reload.sources import open_checkpoint

__all__ = ["RankPrefetch"]

logger = logging.getLogger(__name__)


class RankPrefetch(ABC):
    """The prefetch calls of one rank: the staging it holds and how it reaches the session."""

    rank: RankId
    #: Ranks of this replica on this host (they prefetch at once: the memory bound).
    ranks_on_host: int
    state: session.WeightState
    #: The update whose checkpoint this rank reads or holds in host staging (``prefetch`` up to
    #: ``apply``); kept outside the session, so the rank serves and its guard checks meanwhile.
    _prefetch: Prefetch | None

    # -- what the session core provides ----------------------------------------------------

    @abstractmethod
    def _new_session(
        self, spec: UpdateSpec, processor: type[ModuleProcessor] = ModuleProcessor
    ) -> SessionRecord:
        """A record for a session of ``spec`` (:func:`.session_record.open_record`)."""

    @abstractmethod
    def _require_session(self) -> SessionRecord:
        """The open session's record, or :class:`WrongState`."""

    @abstractmethod
    def _refuse_model_level_hook(self) -> None:
        """Raise :class:`WrongState` for a model whose post-load step cannot be replayed."""

    @abstractmethod
    def _report(self, call: str, *, ok: bool) -> dict[str, Any]:
        """The rank's answer to ``call`` with the open session's progress."""

    # -- the prefetch calls ----------------------------------------------------------------

    def _prefetch_start(self, args: PrefetchArgs) -> dict[str, Any]:
        """Check everything that needs no live state, then start the read (module
        :mod:`.prefetch`). The rank stays clean at its version, serving, its guard armed."""
        spec = args.spec
        if self._prefetch is not None and self._prefetch.spec == spec:
            return self._prefetch_report("prefetch", self._prefetch, ok=True)  # a retried call
        prefetched = session.prefetch(self.state, spec)
        self._refuse_model_level_hook()
        started = time.perf_counter()
        checkpoint = open_checkpoint(args.source, spec)
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
        with timed(active.timings, "load"):
            prepared.apply(active.router.processing, lambda p: failpoints.check(p, self.rank))
        active.router.bytes_loaded += prepared.bytes_loaded
        active.sealed_digests = prepared.digests
        failpoints.check("load.read", self.rank)
        active.loaded(staging.checkpoint, prefix="prefetch_")
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
        return wire_report(
            self.rank,
            self.state,
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
