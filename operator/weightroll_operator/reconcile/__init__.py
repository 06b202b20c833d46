"""One idempotent, level-triggered pass: observe -> plan -> apply -> report (house rule 4).

Every kopf handler of a WeightUpdate (create, update, resume, the loop daemon) calls
:meth:`Reconciler.reconcile`; deletion calls :meth:`Reconciler.finalize`. A pass keeps no state
between calls except caches of *observations* (agent states keyed by the pod's incarnation and
annotations, Secret tokens), so an operator restarted at any point resumes from the cluster:
pod annotations say which pods are in flight and for which update id, agents say how far each
update got.

Passes of one WeightUpdate are serialised by a per-object lock: kopf runs daemons concurrently
with change handlers.

Pods no WeightUpdate selects are handled apart, one pod event at a time: :meth:`Reconciler.admit`
sets their gate True once their containers are ready (``domain/admission.py`` has the rule).

The Reconciler is the pass and the lock; each concept it uses is a collaborator owning its own
caches, in its own module (layers in ``.importlinter``, ``reconcile-layers``):

- ``selection.py`` :class:`SelectionMemo`: views, selection, units and queries of unchanged pods;
- ``observe.py`` :class:`AgentObserver`: agent answers (TTL, backoff, tokens);
- ``confirm.py`` :func:`confirm`: the plan's premises checked (cached answers, peers);
- ``expectations.py`` :class:`WriteExpectations`: "the index has not seen my write yet";
- ``report.py`` :class:`Reporter`: status patch, phase Event, metrics;
- ``left_drained.py`` :class:`LeftDrained`: the series of pods deleted WeightUpdates left drained;
- ``finalize.py`` :class:`Finalizer` and ``admit.py`` :class:`Admitter`: deletion and admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from weightroll_operator.api.v1alpha1 import (
    Phase,
    WeightUpdateSpec,
    WeightUpdateStatus,
    parse_spec,
)
from weightroll_operator.apply import (
    SKIPPED,
    ActionResult,
    ApplyContext,
    EventCounts,
    apply,
)
from weightroll_operator.domain.actions import Action, Claim, Emit, GateOn, Settle
from weightroll_operator.domain.conditions import timestamp
from weightroll_operator.domain.fleet import agent_port_mismatch, terminating_units
from weightroll_operator.domain.model import AgentView, OwnerKey, PodView, owner_key
from weightroll_operator.domain.ownership import precedence
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    Query,
    plan,
    unsettled,
)
from weightroll_operator.domain.status import build_status
from weightroll_operator.domain.wire import check_wire
from weightroll_operator.errors import InvalidSpec, KubeConflict, KubeError, KubeNotFound
from weightroll_operator.gc_pacing import GcPacer
from weightroll_operator.metrics import Metrics
from weightroll_operator.phantoms import Phantoms
from weightroll_operator.ports import AgentPort, KubePort, PeerReader, PodReader
from weightroll_operator.reconcile.admit import Admitter
from weightroll_operator.reconcile.confirm import confirm
from weightroll_operator.reconcile.expectations import WriteExpectations
from weightroll_operator.reconcile.finalize import Finalizer, ReleaseIncomplete
from weightroll_operator.reconcile.left_drained import LeftDrained
from weightroll_operator.reconcile.observe import AgentObserver, backoff_delay
from weightroll_operator.reconcile.report import Reporter
from weightroll_operator.reconcile.selection import Selection, SelectionMemo

__all__ = [
    "PassResult",
    "Reconciler",
    "ReleaseIncomplete",
    "backoff_delay",
    "paused_gc",
    "utcnow",
]

_STATUS_KEYS = {f.alias or n for n, f in WeightUpdateStatus.model_fields.items()}
#: Stands for an answer where a pod's agent was not asked (nothing to confirm about it).
_ANSWERED = AgentView(reachable=True)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside a synchronous step of a pass (no ``await`` in it).

    A pass at 10,000 pods allocates hundreds of thousands of short-lived objects (views,
    units, classes) that reference counting frees when the step ends; a collection during the
    step would promote them to the old generation and so trigger a *full* collection of the
    whole heap (the pod index included) about once a pass, which cost a quarter of the pass
    time (issue 11 G). Nothing else runs during a synchronous step, and collection resumes
    as soon as it ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def utcnow() -> datetime:
    return datetime.now(tz=UTC)


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass did (for handlers, tests and the benchmark)."""

    phase: Phase
    status_written: bool
    actions: tuple[Action, ...]
    errors: tuple[ActionResult, ...]
    #: Seconds until the next pass is useful (units in flight poll sooner).
    delay: float

    @property
    def calls_failed(self) -> bool:
        """A pod write or an agent call failed (not a conflict, re-planned at once, a pod that
        is gone, nor an Event): the caller backs off before the next pass."""
        return any(
            r.error is not SKIPPED
            and not isinstance(r.error, KubeConflict | KubeNotFound)
            and not isinstance(r.action, Emit)
            for r in self.errors
        )


@dataclass(frozen=True, slots=True)
class _Observed:
    """What the observe step of a pass saw."""

    selection: Selection
    views: tuple[PodView, ...]
    agents: dict[str, AgentView]
    #: Pods whose answer came from the cache (an earlier pass's).
    cached: set[str]


@dataclass(slots=True)
class Reconciler:
    """Runs passes for any number of WeightUpdates.

    The arguments marked *(to ...)* configure a collaborator and are read once, at
    construction; change them on the collaborator (``rec.observer.token_ttl``).

    Args:
        kube: the Kubernetes calls (``k8s.client.KubeApi``).
        agents: the agent calls (``agent_client.AgentClient``).
        metrics: optional metrics sink.
        clock: injected time (tests and the benchmark).
        state_ttl: *(to observer and phantoms)* seconds an agent ``/v1/state`` answer is reused
            for an unchanged pod (at most; each answer expires at a random time in the second
            half).
        token_ttl: *(to observer)* seconds an agent token read from its Secret is reused; 0
            (the default): read once per pass, so a Secret that loses its opt-in label (or its
            token) is not sent from the next pass on.
        poll_interval: requeue delay while units are in flight.
        idle_interval: requeue delay otherwise.
        burst: the most pods one pass starts a forward step on (the rest: the next pass, at
            once); ``None``: no limit.
        agent_backoff, agent_backoff_cap: *(to observer)* backoff of an agent that did not
            answer: first retry after about ``agent_backoff`` seconds, at most the cap.
        rand: *(to observer)* jitter of TTLs and backoff.
        monotonic: *(to observer, expectations, phantoms)* monotonic seconds for caches, TTLs
            and backoff (injected by the simulation tier).
        cache_limit: *(to selection and observer)* entries of each per-pod cache before it is
            emptied (pods that vanished leave theirs behind).
    """

    kube: KubePort
    agents: AgentPort
    metrics: Metrics | None = None
    clock: Callable[[], datetime] = utcnow
    concurrency: int = 32
    state_ttl: InitVar[float] = 30.0
    token_ttl: InitVar[float] = 0.0
    poll_interval: float = 2.0
    idle_interval: float = 30.0
    #: The most pods one pass starts a forward step on (``plan``'s ``step_limit``); None: all.
    burst: int | None = None
    #: Paces cyclic garbage collection (``gc_pacing.py``); None: CPython's own, unchanged.
    gc_pacer: GcPacer | None = None
    agent_backoff: InitVar[float] = 1.0
    agent_backoff_cap: InitVar[float] = 60.0
    rand: InitVar[Callable[[], float]] = random.random
    monotonic: InitVar[Callable[[], float]] = time.monotonic
    #: Pod Events posted so far (repeats raise a count; apply.py).
    events: EventCounts = field(default_factory=EventCounts)
    cache_limit: InitVar[int] = 100_000
    #: When this operator process started: downtime before it never counts against deadlines.
    started: datetime | None = None
    #: One lock per WeightUpdate: its passes and its release never overlap.
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, init=False)
    #: Indexed pods the API server confirmed gone (``phantoms``).
    phantoms: Phantoms = field(init=False)
    selection: SelectionMemo = field(init=False)
    observer: AgentObserver = field(init=False)
    expectations: WriteExpectations = field(init=False)
    reporter: Reporter = field(init=False)
    left_drained: LeftDrained = field(init=False)
    finalizer: Finalizer = field(init=False)
    admitter: Admitter = field(init=False)

    def __post_init__(
        self,
        state_ttl: float,
        token_ttl: float,
        agent_backoff: float,
        agent_backoff_cap: float,
        rand: Callable[[], float],
        monotonic: Callable[[], float],
        cache_limit: int,
    ) -> None:
        if self.started is None:
            self.started = self.clock()
        reader = self.kube if isinstance(self.kube, PodReader) else None
        self.phantoms = Phantoms(reader, max(state_ttl, 1.0), monotonic)
        self.selection = SelectionMemo(cache_limit=cache_limit)
        self.observer = AgentObserver(
            agents=self.agents,
            kube=self.kube,
            concurrency=self.concurrency,
            state_ttl=state_ttl,
            token_ttl=token_ttl,
            agent_backoff=agent_backoff,
            agent_backoff_cap=agent_backoff_cap,
            rand=rand,
            monotonic=monotonic,
            cache_limit=cache_limit,
        )
        self.expectations = WriteExpectations(monotonic=monotonic)
        self.reporter = Reporter(self.kube, self.metrics)
        self.left_drained = LeftDrained(self.metrics)
        self.finalizer = Finalizer(
            kube=self.kube,
            agents=self.agents,
            clock=self.clock,
            events=self.events,
            phantoms=self.phantoms,
            observer=self.observer,
            expectations=self.expectations,
            left_drained=self.left_drained,
        )
        self.admitter = Admitter(self.kube, self.clock, self.metrics)

    def begin_acting(self) -> None:
        """This process starts to act now (it took the Lease): the downtime floor of every
        deadline and unit timer (``Persisted.clock_floor``) moves here."""
        self.started = self.clock()

    async def reconcile(
        self,
        body: Mapping[str, Any],
        pods: Iterable[Mapping[str, Any]],
        peers: Iterable[Mapping[str, Any]] = (),
    ) -> PassResult:
        """One pass for the WeightUpdate ``body`` over the observed ``pods``.

        ``peers`` are the other WeightUpdates of the namespace (for fleet-level ownership).

        Raises:
            InvalidSpec: the spec is invalid (the status says why); retry only on a change.
            KubeError: the status or a Secret could not be read or written; retry later.
        """
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        owner = owner_key(namespace, name)
        async with self._locks.setdefault(owner, asyncio.Lock()):
            if meta.get("deletionTimestamp"):
                # Being deleted: :meth:`finalize` releases its pods; a pass now could claim a
                # pod after the release and leave it owned by a WeightUpdate that is gone.
                return PassResult(
                    phase=_phase_of(body), status_written=False, actions=(), errors=(),
                    delay=self.idle_interval,
                )  # fmt: skip
            return await self._pass(body, pods, list(peers), namespace, name, owner)

    async def _pass(
        self,
        body: Mapping[str, Any],
        pods: Iterable[Mapping[str, Any]],
        peers: list[Mapping[str, Any]],
        namespace: str,
        name: str,
        owner: OwnerKey,
    ) -> PassResult:
        now = self.clock()
        meta = body.get("metadata") or {}
        generation = meta.get("generation")
        raw_status = {k: v for k, v in (body.get("status") or {}).items() if k in _STATUS_KEYS}
        try:
            old_status: WeightUpdateStatus | None = WeightUpdateStatus.model_validate(raw_status)
        except ValidationError:
            old_status = None
        try:
            spec = parse_spec(body.get("spec"))
            check_wire(spec, name)
            pods = self.phantoms.live(pods)
            with paused_gc():
                selection = self.selection.select(owner, pods, spec, namespace)
            mismatch = agent_port_mismatch(spec, selection.views)
            if mismatch is not None:
                raise ValueError(mismatch)
        except ValueError as e:
            # Nothing was sent to any pod: a refused spec reaches no agent (no confused deputy).
            # Its passes may stop until the spec changes: keep none of its pod objects meanwhile.
            self.selection.forget(owner)
            await self.reporter.invalid(
                namespace, name, raw_status, old_status, str(e), generation, now
            )
            raise InvalidSpec(str(e)) from e

        self.left_drained.sweep(namespace, pods)
        views = self.expectations.mark_stale(selection.views)
        try:
            # The token Secret's opt-in label is checked on read (InvalidSpec below).
            token = await self.observer.token(namespace, spec)
        except KubeError as e:
            await self.reporter.token_unavailable(
                namespace, name, spec, raw_status, old_status, e, now
            )
            raise
        except InvalidSpec as e:
            await self.reporter.invalid(
                namespace, name, raw_status, old_status, str(e), generation, now
            )
            raise
        persisted = Persisted.from_status(old_status, spec.version)
        persisted = replace(persisted, clock_floor=timestamp(self.started or now))

        # observe
        seen = await self._observe(owner, namespace, pods, selection, views, spec, persisted, token)
        views = seen.views

        # plan (once)
        with paused_gc():
            ranks = precedence(owner, meta, persisted.completion_time is not None, views, peers)
            fleet = Fleet(
                name=name,
                owner=owner,
                pods=views,
                agents=seen.agents,
                peers=ranks.blocked_by,
                superseded=ranks.superseded,
                uid=str(meta.get("uid") or ""),
                generation=int(meta.get("generation") or 0),
                units=self.selection.group(owner, views, spec.group_by),
                terminating=terminating_units(seen.selection.deleting, spec, namespace, owner),
            )
            the_plan = plan(spec, fleet, persisted, now, step_limit=self.burst)

        # confirm: a unit whose premise no longer holds is dropped from this pass
        async def ask_afresh(names: frozenset[str]) -> Mapping[str, AgentView]:
            fresh = {n: Query(state=True) for n in names}
            return await self.observer.observe(fleet.pods, fresh, token, fresh_only=True)

        async def peers_changed() -> bool:
            assert isinstance(self.kube, PeerReader)
            listed = await self.kube.list_weightupdates(namespace)
            finished = persisted.completion_time is not None
            return precedence(owner, meta, finished, fleet.pods, listed) != ranks

        confirmed = await confirm(
            the_plan.actions,
            the_plan.premises,
            seen.cached,
            ask_afresh,
            peers_changed if isinstance(self.kube, PeerReader) else None,
        )
        dropped = confirmed.dropped
        if confirmed.answers:
            fleet = replace(fleet, agents={**fleet.agents, **confirmed.answers})
        if dropped:
            the_plan = replace(the_plan, actions=confirmed.actions)

        # apply
        ctx = ApplyContext(
            kube=self.kube,
            agents=self.agents,
            owner=owner,
            namespace=namespace,
            name=name,
            uid=meta.get("uid"),
            token=token,
            now=now,
            concurrency=self.concurrency,
            events=self.events,
        )
        results = await apply(the_plan.actions, ctx)
        self.expectations.remember(results)

        # report
        failed = [r.action for r in results if not r.ok and not isinstance(r.action, Emit)]
        the_plan = unsettled(
            the_plan,
            (*dropped, *(a.pod.name for a in failed if isinstance(a, GateOn | Settle))),
            persisted,
            unclaimed=(*dropped, *(a.pod.name for a in failed if isinstance(a, Claim))),
        )
        #: Pods with an action that did not happen (it failed, or its premise no longer held):
        #: what the plan said of them is not so yet.
        unwritten = dropped | {a.pod.name for a in failed}
        notes = {
            r.action.pod.name: f"{type(r.action).__name__}Failed: {r.error}"[:300]
            for r in results
            if r.error is not None
            and not isinstance(r.action, Emit)
            and r.error is not SKIPPED
            and not isinstance(r.error, KubeConflict)  # re-read and re-planned next pass
        }
        with paused_gc():
            status = build_status(the_plan, spec, old_status, generation, now, notes, owner=owner)
        written = await self.reporter.report(
            ctx, raw_status, old_status, status, spec, the_plan, fleet.agents, unwritten
        )
        errors = tuple(r for r in results if not r.ok)
        # Only in-flight units need polling (their agents commit without a pod event); a pending
        # unit becomes startable on a pod event (a restore, a pod turning Ready), which wakes the
        # loop (loop.py).
        busy = the_plan.in_flight_units > 0
        # Steps the burst limit left for later, and units dropped for an agent answer that
        # changed (the fresh one is cached now), are taken by the next pass, at once. Units
        # dropped for their peers wait for the index of WeightUpdates to catch up: polled, so a
        # lagging watch does not turn the loop into back-to-back listings of the namespace.
        delay = self.poll_interval if busy or dropped else self.idle_interval
        if the_plan.deferred or confirmed.answer_changed:
            delay = 0.0
        if self.gc_pacer is not None:
            self.gc_pacer.after_pass()
        return PassResult(
            phase=status.phase,
            status_written=written,
            actions=the_plan.actions,
            errors=errors,
            delay=delay,
        )

    async def _observe(
        self,
        owner: OwnerKey,
        namespace: str,
        pods: list[Mapping[str, Any]],
        selection: Selection,
        views: tuple[PodView, ...],
        spec: WeightUpdateSpec,
        persisted: Persisted,
        token: str | None,
    ) -> _Observed:
        """What the agents of ``views`` (the selection's, those predating our writes marked
        stale) say; pods the API server confirms gone are left out and the rest selected and
        observed again, as if their DELETED events had come: their units are released, not
        timed out (``phantoms``)."""
        with paused_gc():
            asked = self.selection.queries(owner, views, spec, persisted.retried_at)
        cached: set[str] = set()
        agents = await self.observer.observe(views, asked, token, cached)
        gone = await self.phantoms.confirm_gone(
            v for v in views if v.ip is not None and not agents.get(v.name, _ANSWERED).reachable
        )
        if gone:
            pods = self.phantoms.live(pods)
            with paused_gc():
                selection = self.selection.select(owner, pods, spec, namespace)
            views = self.expectations.mark_stale(selection.views)
            with paused_gc():
                asked = self.selection.queries(owner, views, spec, persisted.retried_at)
            cached = set()
            agents = await self.observer.observe(views, asked, token, cached)
        return _Observed(selection, views, agents, cached)

    async def finalize(
        self,
        body: Mapping[str, Any],
        pods: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
    ) -> int:
        """Release every pod a deleted WeightUpdate owns; return how many were released.

        ``pods`` may be a function that reads the pod index: it is called once this
        WeightUpdate's lock is held, so a pass that claimed a pod just before cannot be missed
        (kopf runs the deletion handler beside the daemon's last pass). A pod whose view still
        predates our own last write to it cannot be judged yet: the release is retried.

        The decision per pod is :func:`~weightroll_operator.domain.release.release`
        (``finalize.py``). Once every pod is released, this WeightUpdate's caches and series
        are dropped (the drained series of the pods it left drained stay).

        Raises:
            ReleaseIncomplete: some pods could not be released yet (agent unreachable or still
                winding down, a write failed); the caller keeps the finalizer and retries.
        """
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        owner = owner_key(namespace, name)
        async with self._locks.setdefault(owner, asyncio.Lock()):
            released = await self.finalizer.release(body, owner, pods)
            self._locks.pop(owner, None)
            self.selection.forget(owner)
            # every pod this WeightUpdate left drained, in this call or an earlier one
            self.reporter.forget(namespace, name, self.left_drained.left_by(namespace, name))
            return released

    async def admit(self, pod: Mapping[str, Any], peers: Iterable[Mapping[str, Any]]) -> bool:
        """:meth:`Admitter.admit`: the gate of ``pod`` True on its boot weights if no
        WeightUpdate governs it; whether it was written. Never raises for the API."""
        return await self.admitter.admit(pod, peers)

    async def admit_all(
        self,
        pods: Iterable[Mapping[str, Any]],
        peers: Iterable[Mapping[str, Any]],
        *,
        gone: str | None = None,
    ) -> int:
        """:meth:`Admitter.admit_all`: admit every pod of ``pods`` that awaits admission, with
        the WeightUpdate ``gone`` left out of ``peers``; how many were."""
        return await self.admitter.admit_all(pods, peers, gone=gone)

    def note_left_drained(self, pod: Mapping[str, Any], *, deleted: bool = False) -> None:
        """:meth:`LeftDrained.note`: track ``pod`` if a deleted WeightUpdate left it drained
        (its drained series is exported); a ``deleted`` pod loses its series."""
        self.left_drained.note(pod, deleted=deleted)


def _phase_of(body: Mapping[str, Any]) -> Phase:
    """The phase the WeightUpdate's status records (Pending when none can be read)."""
    try:
        return Phase((body.get("status") or {}).get("phase") or Phase.PENDING)
    except ValueError:
        return Phase.PENDING
