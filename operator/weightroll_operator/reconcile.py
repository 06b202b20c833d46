"""One idempotent, level-triggered pass: observe -> plan -> apply -> status (house rule 4).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from engine_agent.protocol import EngineState, UpdatePhase
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
    bounded_map,
    target_of,
    write_gate,
)
from weightroll_operator.credentials import token_problem, with_token_condition
from weightroll_operator.domain import admission
from weightroll_operator.domain.actions import Action, Claim, Emit, GateOff, GateOn, Settle
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.domain.fleet import (
    AGENT_PORT_NAME,
    Unit,
    agent_port_mismatch,
    group_units,
    pod_view,
    select_one,
    terminating_units,
)
from weightroll_operator.domain.model import (
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    AgentView,
    OwnerKey,
    PodView,
    SourceRef,
    UnitState,
    UpdateId,
    UpdateView,
    WeightState,
    make_update_id,
    owner_key,
)
from weightroll_operator.domain.ownership import precedence
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    Plan,
    Query,
    parse_time,
    plan,
    queries,
    target_source,
    unsettled,
)
from weightroll_operator.domain.release import DELETED_SUFFIX, release
from weightroll_operator.domain.status import build_status, invalid_status, status_patch
from weightroll_operator.domain.wire import check_wire
from weightroll_operator.errors import (
    AgentError,
    InvalidSpec,
    KubeConflict,
    KubeError,
    KubeNotFound,
    WeightrollError,
)
from weightroll_operator.gc_pacing import GcPacer
from weightroll_operator.metrics import Metrics
from weightroll_operator.phantoms import Phantoms
from weightroll_operator.ports import AgentPort, KubePort, PeerReader, PodReader

__all__ = [
    "PassResult",
    "Reconciler",
    "ReleaseIncomplete",
    "backoff_delay",
    "paused_gc",
    "utcnow",
]

log = logging.getLogger(__name__)
_STATUS_KEYS = {f.alias or n for n, f in WeightUpdateStatus.model_fields.items()}


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


def backoff_delay(
    failures: int, base: float, cap: float, rand: Callable[[], float] = random.random
) -> float:
    """Exponential backoff with jitter: ``base * 2**(failures-1)``, capped, times 0.5-1.5.

    The jitter spreads retries of many pods (or WeightUpdates) failing together.
    """
    exp = base * (2 ** max(0, min(failures - 1, 30)))
    return float(min(cap, exp) * (0.5 + rand()))


class ReleaseIncomplete(WeightrollError):
    """Deletion could not release every pod yet; the finalizer stays and deletion retries."""


#: Seconds a pod view at the version our write was planned from is treated as stale when the
#: write did not report a new version (a no-op write leaves the resourceVersion unchanged, so
#: the view is trusted again after this). A write that reported a new version makes every view
#: at the old one stale for as long as the index serves it: trusting it again after 30 s let a
#: pass on an index that lagged two minutes see a pod it drained as Ready and drain another
#: (two out with a budget of 1, found by the simulation tier).
_STALE_FOR = 30.0
#: Stands for an answer where a pod's agent was not asked (nothing to confirm about it).
_ANSWERED = AgentView(reachable=True)


@dataclass(frozen=True, slots=True)
class _Selection:
    """One pass's selection of a WeightUpdate's pods (``Reconciler._select``)."""

    #: What it was made with: (namespace, selector, groupBy).
    signature: tuple[Any, ...]
    #: By ``id()`` of each pod object given: (the object, its view, or None when not selected).
    judged: dict[int, tuple[Mapping[str, Any], PodView | None]]
    #: The selected pods' views, by name.
    views: tuple[PodView, ...]
    #: Pod objects left out because they are being deleted (``terminating_units`` reads them).
    deleting: tuple[Mapping[str, Any], ...]
    #: The pod object of each view (same order), and each view's position by pod name.
    objects: tuple[Mapping[str, Any], ...]
    positions: dict[str, int]


_NO_HIT: tuple[None, None] = (None, None)


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


@dataclass
class Reconciler:
    """Runs passes for any number of WeightUpdates.

    Args:
        kube: the Kubernetes calls (``k8s.client.KubeApi``).
        agents: the agent calls (``agent_client.AgentClient``).
        metrics: optional metrics sink.
        clock: injected time (tests and the benchmark).
        state_ttl: seconds an agent ``/v1/state`` answer is reused for an unchanged pod (at
            most; each answer expires at a random time in the second half).
        token_ttl: seconds an agent token read from its Secret is reused; 0 (the default): read
            once per pass, so a Secret that loses its opt-in label (or its token) is not sent
            from the next pass on.
        poll_interval: requeue delay while units are in flight.
        idle_interval: requeue delay otherwise.
        burst: the most pods one pass starts a forward step on (the rest: the next pass, at
            once); ``None``: no limit.
    """

    kube: KubePort
    agents: AgentPort
    metrics: Metrics | None = None
    clock: Callable[[], datetime] = utcnow
    concurrency: int = 32
    state_ttl: float = 30.0
    token_ttl: float = 0.0
    poll_interval: float = 2.0
    idle_interval: float = 30.0
    #: The most pods one pass starts a forward step on (``plan``'s ``step_limit``); None: all.
    burst: int | None = None
    #: Paces cyclic garbage collection (``gc_pacing.py``); None: CPython's own, unchanged.
    gc_pacer: GcPacer | None = None
    #: Backoff of an agent that did not answer: first retry after about this many seconds.
    agent_backoff: float = 1.0
    agent_backoff_cap: float = 60.0
    rand: Callable[[], float] = random.random
    #: Monotonic seconds for caches, TTLs and backoff (injected by the simulation tier).
    monotonic: Callable[[], float] = time.monotonic
    #: Pod Events posted so far (repeats raise a count; apply.py).
    events: EventCounts = field(default_factory=EventCounts)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _tokens: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)
    #: Per pod (namespace, name): the :func:`_state_key` the answer is valid for, the answer
    #: and its expiry (one entry per pod, like ``_views``).
    #: (The view the answer was got for: a key equal by identity needs no comparison.)
    _states: dict[tuple[str, str], tuple[tuple[str, ...], AgentView, float, PodView]] = field(
        default_factory=dict
    )
    _views: dict[tuple[str, str], tuple[Mapping[str, Any], str | None, PodView]] = field(
        default_factory=dict
    )
    #: Per WeightUpdate: the views its last pass asked agents about, with the version, source
    #: and retry mark of that pass, and the queries (``_queries``).
    _asked: dict[OwnerKey, tuple[tuple[PodView, ...], tuple[Any, ...], Mapping[str, Query]]] = (
        field(default_factory=dict)
    )
    #: The views of the last ``_observe`` call and those views by pod name.
    _by_name: tuple[tuple[PodView, ...], dict[str, PodView]] | None = None
    #: Per WeightUpdate: the views its last pass grouped, the units and the units by key
    #: (``group_units`` reuses those whose views are the same objects).
    _units: dict[OwnerKey, tuple[tuple[PodView, ...], tuple[Unit, ...], dict[str, Unit] | None]] = (
        field(default_factory=dict)
    )
    #: Per pod (namespace, name): the last view :func:`_state_key` was computed for, and the key.
    _state_keys: dict[tuple[str, str], tuple[PodView, tuple[str, ...]]] = field(
        default_factory=dict
    )
    #: Entries of each cache before it is emptied (pods that vanished leave theirs behind).
    cache_limit: int = 100_000
    #: Per WeightUpdate: its last pass's selection (:class:`_Selection`). Rebuilt when a pod
    #: object changed, so it holds only the objects the last pass was given.
    _selections: dict[OwnerKey, _Selection] = field(default_factory=dict)
    #: (namespace, pod) -> (the resourceVersion a write was planned from, whether the write
    #: reported another one, monotonic time): views at that version predate our write.
    _written: dict[tuple[str, str], tuple[str, bool, float]] = field(default_factory=dict)
    #: (namespace, pod, incarnation) -> (consecutive agent failures, monotonic retry time, view).
    _agent_failures: dict[tuple[str, str, str], tuple[int, float, AgentView]] = field(
        default_factory=dict
    )
    #: namespace -> pod -> (deleted WeightUpdate that left it drained, drained since): its
    #: drained series is kept until the pod serves again.
    _left_drained: dict[str, dict[str, tuple[str, float]]] = field(default_factory=dict)
    #: When this operator process started: downtime before it never counts against deadlines.
    started: datetime | None = None
    #: Indexed pods the API server confirmed gone (``phantoms``).
    phantoms: Phantoms = field(init=False)

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()
        reader = self.kube if isinstance(self.kube, PodReader) else None
        self.phantoms = Phantoms(reader, max(self.state_ttl, 1.0), self.monotonic)

    def begin_acting(self) -> None:
        """This process starts to act now (it took the Lease): the downtime floor of every
        deadline and unit timer (``Persisted.clock_floor``) moves here."""
        self.started = self.clock()

    def _view(self, pod: Mapping[str, Any], group_by: str | None) -> PodView:
        """:func:`pod_view`, reused while the *same* pod object is passed again.

        The kopf index (like a watch) hands over a new object for every change and never
        mutates one, so object identity is a change token. One entry per pod (namespace, name):
        a new object of the pod replaces the old one, so superseded pod objects are never kept
        (issue 11 finding 7); the cache holds at most the live pods plus those deleted since it
        was last emptied.
        """
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        cached = self._views.get(key)
        if cached is not None and cached[0] is pod and cached[1] == group_by:
            return cached[2]
        if cached is None and len(self._views) >= self.cache_limit:
            self._views.clear()
            self._state_keys.clear()
        result = pod_view(pod, group_by=group_by)
        self._views[key] = (pod, group_by, result)
        return result

    def _select(
        self,
        owner: OwnerKey,
        pods: list[Mapping[str, Any]],
        spec: WeightUpdateSpec,
        namespace: str,
    ) -> _Selection:
        """:func:`~weightroll_operator.domain.fleet.select_pods`, judging each pod object once.

        Object identity is the change token (see :meth:`_view`): a pod object seen by the
        previous pass of this WeightUpdate, under the same selection, keeps its verdict and view;
        at 10,000 pods this is most of them, and the selector is not evaluated again. When no
        pod object changed at all (most passes while units are in flight: only agents move),
        the previous selection is returned as it is, the same tuple of views included, so the
        units grouped from it are reused too; when only selected pods changed and stay
        selected (a batch claimed or restored), their views replace the old ones in place.
        """
        signature = (namespace, spec.selector, spec.group_by)
        previous = self._selections.get(owner)
        if previous is not None and previous.signature != signature:
            previous = None
        known = previous.judged if previous is not None else {}
        if previous is not None and len(pods) == len(known):
            changed = [pod for pod in pods if (known.get(id(pod)) or _NO_HIT)[0] is not pod]
            if not changed:
                return previous
            replaced = self._reselect(previous, changed, spec, namespace, owner)
            if replaced is not None:
                self._selections[owner] = replaced
                return replaced
        judged: dict[int, tuple[Mapping[str, Any], PodView | None]] = {}
        views: list[tuple[PodView, Mapping[str, Any]]] = []
        deleting: list[Mapping[str, Any]] = []
        for pod in pods:
            hit = known.get(id(pod))
            if hit is not None and hit[0] is pod:
                view = hit[1]
            else:
                view = select_one(pod, spec, namespace, self._view, owner)
            judged[id(pod)] = (pod, view)
            if view is not None:
                views.append((view, pod))
            elif (pod.get("metadata") or {}).get("deletionTimestamp"):
                deleting.append(pod)
        views.sort(key=lambda pair: pair[0].name)
        selection = _Selection(
            signature,
            judged,
            tuple(v for v, _ in views),
            tuple(deleting),
            tuple(p for _, p in views),
            {v.name: i for i, (v, _) in enumerate(views)},
        )
        self._selections[owner] = selection
        return selection

    def _reselect(
        self,
        previous: _Selection,
        changed: list[Mapping[str, Any]],
        spec: WeightUpdateSpec,
        namespace: str,
        owner: OwnerKey,
    ) -> _Selection | None:
        """``previous`` with the new objects ``changed`` of pods it selected, each still
        selected, in place (same order); ``None`` when the selection itself changed (a pod
        joined, left or is being deleted): the caller selects anew."""
        views, objects = list(previous.views), list(previous.objects)
        judged = dict(previous.judged)
        for pod in changed:
            meta = pod.get("metadata") or {}
            at = previous.positions.get(str(meta.get("name", "")))
            if at is None:
                return None
            view = select_one(pod, spec, namespace, self._view, owner)
            if view is None or view.name != views[at].name:
                return None
            judged.pop(id(objects[at]), None)
            judged[id(pod)] = (pod, view)
            views[at], objects[at] = view, pod
        if len(judged) != len(previous.judged):
            return None  # one pod given twice: select anew
        return _Selection(
            previous.signature,
            judged,
            tuple(views),
            previous.deleting,
            tuple(objects),
            previous.positions,
        )

    def _mark_stale(self, views: tuple[PodView, ...]) -> tuple[PodView, ...]:
        """Flag views that predate our own last write to the pod (issue 11, finding C).

        The pod index lags our writes; a view still at the resourceVersion a write was planned
        from would show a pod we drained as Ready, or a pod whose gate we restored as not yet
        touched. Such a pod's unit gets no step and counts as unavailable until a newer view
        arrives (or ``_STALE_FOR`` passes: a write that changed nothing keeps the version).
        ``views`` itself (the same object) when none is flagged.
        """
        if not self._written:
            return views
        now = self.monotonic()
        out = list(views)
        flagged = False
        for i, view in enumerate(views):
            key = (view.namespace, view.name)
            mark = self._written.get(key)
            if mark is not None:
                read, moved, at = mark
                if view.resource_version == read and (moved or now - at < _STALE_FOR):
                    out[i] = replace(view, stale=True)
                    flagged = True
                else:
                    del self._written[key]
        return tuple(out) if flagged else views

    def _queries(
        self,
        owner: OwnerKey,
        views: tuple[PodView, ...],
        spec: WeightUpdateSpec,
        retried_at: str | None,
    ) -> Mapping[str, Query]:
        """:func:`queries`, reused while ``views`` is the very tuple it was made from (no pod
        changed) and the spec's version, source and the retry mark are the same."""
        source = target_source(spec)
        signature = (spec.version, source, retried_at)
        last = self._asked.get(owner)
        if last is not None and last[0] is views and last[1] == signature:
            return last[2]
        asked = queries(views, owner, spec.version, source, retried_at)
        self._asked[owner] = (views, signature, asked)
        return asked

    def _group(
        self, owner: OwnerKey, views: tuple[PodView, ...], group_by: str | None
    ) -> tuple[Unit, ...]:
        """:func:`group_units` of ``views``, reusing the last pass's units: all of them when
        ``views`` is the very tuple they were grouped from, else those of unchanged views.
        Without ``groupBy`` a unit is one pod, in the views' order: when the same pods are
        there, only the units of changed views are built again, in place."""
        last = self._units.get(owner)
        if last is not None and last[0] is views:
            return last[1]
        if group_by is None and last is not None and len(last[0]) == len(views):
            old, singles = last[0], list(last[1])
            for i, view in enumerate(views):
                if view is not old[i]:
                    if view.name != old[i].name:
                        break
                    singles[i] = Unit(view.unit, (view,))
            else:
                units = tuple(singles)
                self._units[owner] = (views, units, None)
                return units
        units = group_units(views, self._units_by_key(last))
        self._units[owner] = (views, units, None)
        return units

    @staticmethod
    def _units_by_key(
        last: tuple[tuple[PodView, ...], tuple[Unit, ...], dict[str, Unit] | None] | None,
    ) -> dict[str, Unit] | None:
        if last is None:
            return None
        return last[2] if last[2] is not None else {u.key: u for u in last[1]}

    def _remember_writes(self, results: Iterable[ActionResult]) -> None:
        now = self.monotonic()
        for result in results:
            action = result.action
            if (
                result.ok
                and isinstance(action, Claim | GateOff | GateOn | Settle)
                and action.pod.resource_version
            ):
                key = (action.pod.namespace, action.pod.name)
                read = action.pod.resource_version
                moved = result.resource_version not in (None, read)
                mark = self._written.get(key)
                if mark is None or mark[0] != read:
                    self._written[key] = (read, moved, now)
                elif moved and not mark[1]:
                    self._written[key] = (read, True, mark[2])
        if len(self._written) > 200_000:
            self._written.clear()

    # ------------------------------------------------------------------------------------------

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
                selection = self._select(owner, pods, spec, namespace)
            selected = selection.views
            mismatch = agent_port_mismatch(spec, selected)
            if mismatch is not None:
                raise ValueError(mismatch)
        except ValueError as e:
            # Nothing was sent to any pod: a refused spec reaches no agent (no confused deputy).
            # Its passes may stop until the spec changes: keep none of its pod objects meanwhile.
            self._selections.pop(owner, None)
            self._units.pop(owner, None)
            self._asked.pop(owner, None)
            await self._report_invalid(
                namespace, name, raw_status, old_status, str(e), generation, now
            )
            raise InvalidSpec(str(e)) from e

        self._sweep_left_drained(namespace, pods)
        views = self._mark_stale(selected)
        try:
            # The token Secret's opt-in label is checked on read (InvalidSpec below).
            token = await self._token(namespace, spec)
        except KubeError as e:
            await self._token_unavailable(namespace, name, spec, raw_status, old_status, e, now)
            raise
        except InvalidSpec as e:
            await self._report_invalid(
                namespace, name, raw_status, old_status, str(e), generation, now
            )
            raise
        persisted = Persisted.from_status(old_status, spec.version)
        persisted = replace(persisted, clock_floor=timestamp(self.started or now))
        with paused_gc():
            asked = self._queries(owner, views, spec, persisted.retried_at)
        cached: set[str] = set()
        agents = await self._observe(views, asked, token, cached)
        gone = await self.phantoms.confirm_gone(
            v for v in views if v.ip is not None and not agents.get(v.name, _ANSWERED).reachable
        )
        if gone:
            # Left out as if their DELETED events had come: their units are released, not
            # timed out (``phantoms``).
            pods = self.phantoms.live(pods)
            with paused_gc():
                selection = self._select(owner, pods, spec, namespace)
            views = self._mark_stale(selection.views)
            with paused_gc():
                asked = self._queries(owner, views, spec, persisted.retried_at)
            cached = set()
            agents = await self._observe(views, asked, token, cached)
        with paused_gc():
            ranks = precedence(owner, meta, persisted.completion_time is not None, views, peers)
            units = self._group(owner, views, spec.group_by)
            fleet = Fleet(
                name=name,
                owner=owner,
                pods=views,
                agents=agents,
                peers=ranks.blocked_by,
                superseded=ranks.superseded,
                uid=str(meta.get("uid") or ""),
                generation=int(meta.get("generation") or 0),
                units=units,
                cached=frozenset(cached),
                terminating=terminating_units(selection.deleting, spec, namespace, owner),
            )
            the_plan = plan(spec, fleet, persisted, now, step_limit=self.burst, provisional=True)
        for _round in range(2):
            # A claim needs a fresh answer from the agents it names; the plan made some on
            # cached ones (``Plan.refresh``): ask those agents now. The very same answers
            # confirm the plan (it is then the plan those fresh answers make); other answers
            # (a trainer push meanwhile) are planned again, rather than a pass later.
            if not the_plan.refresh:
                break
            refresh = the_plan.refresh
            fresh = {n: Query(state=True) for n in refresh}
            answers = await self._observe(views, fresh, token, fresh_only=True)
            confirmed = all(answers.get(n) == agents.get(n) for n in refresh)
            agents = {**agents, **answers}
            cached -= refresh
            fleet = replace(fleet, agents=agents, cached=frozenset(cached))
            if confirmed:
                the_plan = replace(the_plan, refresh=frozenset())
                break
            with paused_gc():
                the_plan = plan(
                    spec, fleet, persisted, now, step_limit=self.burst, provisional=True
                )
        if the_plan.refresh:
            # Still resting on answers not confirmed: only claims made on fresh ones go out.
            with paused_gc():
                the_plan = plan(spec, fleet, persisted, now, step_limit=self.burst)
        if _starts_units(the_plan, owner) and isinstance(self.kube, PeerReader):
            # A claim rests on a fresh view of the peers too, as on fresh agent answers: the
            # index of WeightUpdates may not hold an older one created together with this one
            # (each drained a pod in its first pass, issue 27 item 3). The API server's list
            # does; precedence decided on it again is planned again if it differs. A list that
            # fails raises before anything is applied: no claim on an unconfirmed view.
            listed = await self.kube.list_weightupdates(namespace)
            listed_ranks = precedence(
                owner, meta, persisted.completion_time is not None, views, listed
            )
            if listed_ranks != ranks:
                ranks = listed_ranks
                fleet = replace(fleet, peers=ranks.blocked_by, superseded=ranks.superseded)
                with paused_gc():
                    the_plan = plan(spec, fleet, persisted, now, step_limit=self.burst)
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
        self._remember_writes(results)
        the_plan = unsettled(
            the_plan,
            (
                r.action.pod.name
                for r in results
                if not r.ok and isinstance(r.action, GateOn | Settle)
            ),
            persisted,
        )
        #: Pods with an action that did not happen: what the plan said of them is not so yet.
        unwritten = frozenset(
            r.action.pod.name for r in results if not r.ok and not isinstance(r.action, Emit)
        )
        notes = {
            r.action.pod.name: f"{type(r.action).__name__}Failed: {r.error}"[:300]
            for r in results
            if r.error is not None
            and not isinstance(r.action, Emit)
            and r.error is not SKIPPED
            and not isinstance(r.error, KubeConflict)  # re-read and re-planned next pass
        }
        with paused_gc():
            status = build_status(the_plan, spec, old_status, generation, now, notes)
        status = with_token_condition(status, None, now)
        if self.metrics is not None:
            self.metrics.observe_token(namespace, name, None)
        written = await self._write_status(namespace, name, raw_status, status)
        if old_status is None or old_status.phase is not status.phase:
            await self._phase_event(ctx, old_status, status)
        self._observe_metrics(
            namespace, name, spec, the_plan, old_status, status, agents, now, unwritten
        )
        errors = tuple(r for r in results if not r.ok)
        # Only in-flight units need polling (their agents commit without a pod event); a pending
        # unit becomes startable on a pod event (a restore, a pod turning Ready), which wakes the
        # loop (loop.py).
        busy = the_plan.in_flight_units > 0
        # Steps the burst limit left for later are taken by the next pass, at once.
        delay = 0.0 if the_plan.deferred else self.poll_interval if busy else self.idle_interval
        if self.gc_pacer is not None:
            self.gc_pacer.after_pass()
        return PassResult(
            phase=status.phase,
            status_written=written,
            actions=the_plan.actions,
            errors=errors,
            delay=delay,
        )

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

        The decision per pod is :func:`~weightroll_operator.domain.release.release`: running
        updates are aborted, committed ones settled, pods whose agent is ready go back into
        traffic, the others stay drained (their drained series stays exported). Up to two rounds
        run here (abort, then observe the verdict).

        Raises:
            ReleaseIncomplete: some pods could not be released yet (agent unreachable or still
                winding down, a write failed); the caller keeps the finalizer and retries.
        """
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        owner = owner_key(namespace, name)
        async with self._locks.setdefault(owner, asyncio.Lock()):
            try:
                spec: WeightUpdateSpec | None = parse_spec(body.get("spec"))
            except ValueError:
                spec = None
            views = self._mark_stale(
                tuple(
                    pod_view(raw, group_by=None)
                    for raw in self.phantoms.live(pods() if callable(pods) else pods)
                    if (raw.get("metadata") or {}).get("namespace") == namespace
                )
            )
            lagging = sorted(v.name for v in views if v.stale)
            if lagging:
                raise ReleaseIncomplete(
                    f"{', '.join(lagging[:10])}: the pod index has not caught up with the "
                    "operator's last write; retried"
                )
            remaining = [v for v in views if v.owner == owner]
            token = None
            if spec is not None and remaining:
                # Only agents need the token: with no pod left to release, a Secret deleted
                # with the WeightUpdate (one manifest, or its namespace) cannot hold deletion.
                try:
                    token = await self._token(namespace, spec)
                except KubeError as e:
                    raise ReleaseIncomplete(f"cannot read the agent token: {e}") from e
                except InvalidSpec:
                    # The Secret does not opt in: no token is sent anywhere (no confused deputy).
                    token = None
            ctx = ApplyContext(
                kube=self.kube,
                agents=self.agents,
                owner=owner,
                namespace=namespace,
                name=name,
                uid=meta.get("uid"),
                token=token,
                now=self.clock(),
                events=self.events,
            )
            released = 0
            left: dict[str, float] = {}
            failed: dict[str, str] = {}
            outcome = None
            for _round in range(2):
                agents = await self._observe_for_release(remaining, token)
                gone = await self.phantoms.confirm_gone(
                    v for v in remaining if v.ip is not None and not agents[v.name].reachable
                )
                # a pod that is gone has nothing left to release (``phantoms``)
                remaining = [v for v in remaining if v.name not in gone]
                outcome = release(
                    remaining,
                    agents,
                    owner,
                    traffic_label=spec.strategy.traffic_label if spec is not None else None,
                    fallback=_orphan_state(owner, spec),
                )
                results = await apply(outcome.actions, ctx)
                failed = {
                    r.action.pod.name: str(r.error)
                    for r in results
                    if r.error is not None and not isinstance(r.action, Emit)
                }
                done = [n for n in outcome.released if n not in failed]
                released += len(done)
                left.update({n: t for n, t in outcome.drained_since.items() if n in done})
                remaining = [v for v in remaining if v.name in outcome.pending or v.name in failed]
                if not remaining or not any(
                    n in outcome.pending for n in (v.name for v in remaining)
                ):
                    break
            self._track_left_drained(namespace, name, left)
            if remaining:
                why = {**(outcome.pending if outcome else {}), **failed}
                raise ReleaseIncomplete(
                    "; ".join(f"{n}: {w}" for n, w in sorted(why.items())[:10])
                    or "release incomplete"
                )
            self._locks.pop(owner, None)
            self._selections.pop(owner, None)
            self._units.pop(owner, None)
            self._asked.pop(owner, None)
            if self.metrics is not None:
                # every pod this WeightUpdate left drained, in this call or an earlier one
                keep = {
                    pod: since
                    for pod, (by, since) in self._left_drained.get(namespace, {}).items()
                    if by == name
                }
                self.metrics.forget(namespace, name, keep_drained=keep)
            return released

    async def _observe_for_release(
        self, views: Iterable[PodView], token: str | None
    ) -> dict[str, AgentView]:
        asked = {
            v.name: Query(
                state=True,
                update_id=v.state.update_id
                if v.state is not None and v.state.state.in_flight
                else None,
            )
            for v in views
        }
        by_name = {v.name: v for v in views}

        async def one(item: tuple[str, Query]) -> tuple[str, AgentView]:
            name, query = item
            return name, await self._ask(by_name[name], query, token, full=True)

        return dict(await bounded_map(one, list(asked.items()), self.concurrency))

    def _track_left_drained(self, namespace: str, name: str, pods: Mapping[str, float]) -> None:
        if pods:
            here = self._left_drained.setdefault(namespace, {})
            here.update({pod: (name, since) for pod, since in pods.items()})

    def note_left_drained(self, pod: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Track ``pod`` if a deleted WeightUpdate left it drained (its ``weight-state`` is by
        ``<owner>~deleted`` and its gate is False), exporting its drained series.

        Called for every pod event, the initial listing included: the series of pods left
        drained lived only in this process, so a restarted operator (an upgrade, a failover to
        the standby) lost them and ``WeightReplicaLeftDrained`` resolved while the capacity
        stayed lost. The pod's own record survives; this rebuilds the series from it. A pod
        that is ``deleted`` (its DELETED event) loses its series.
        """
        meta = pod.get("metadata") or {}
        if deleted:
            namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
            left = self._left_drained.get(namespace, {})
            entry = left.pop(name, None)
            if entry is not None and self.metrics is not None:
                self.metrics.restored(namespace, entry[0], [name])
            if not left:
                self._left_drained.pop(namespace, None)
            return
        raw = (meta.get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE)
        if not raw or DELETED_SUFFIX not in raw:  # most pods: no parse
            return
        view = pod_view(pod, group_by=None)
        st = view.state
        if st is None or not st.by.endswith(DELETED_SUFFIX) or view.gate is not False:
            return
        if view.deleting or view.name in self._left_drained.get(view.namespace, {}):
            return
        gone = st.by.removesuffix(DELETED_SUFFIX).rpartition("/")[2]
        started = parse_time(st.started_at)
        since = started.timestamp() if started is not None else time.time()
        self._track_left_drained(view.namespace, gone, {view.name: since})
        if self.metrics is not None:
            self.metrics.left_drained(view.namespace, gone, {view.name: since})

    def _sweep_left_drained(self, namespace: str, pods: Iterable[Mapping[str, Any]]) -> None:
        """Drop the drained series of pods a deleted WeightUpdate left drained, once they are
        back in traffic (gate True) or gone."""
        left = self._left_drained.get(namespace)
        if not left:
            return
        serving: set[str] = set()
        present: set[str] = set()
        for raw in pods:
            pname = str((raw.get("metadata") or {}).get("name"))
            if pname not in left:
                continue
            present.add(pname)
            for c in (raw.get("status") or {}).get("conditions") or []:
                if c.get("type") == CONDITION_WEIGHTS_READY and c.get("status") == "True":
                    serving.add(pname)
        done = [p for p in left if p in serving or p not in present]
        for pname in done:
            gone_name, _ = left.pop(pname)
            if self.metrics is not None:
                self.metrics.restored(namespace, gone_name, [pname])
        if not left:
            self._left_drained.pop(namespace, None)

    async def admit(self, pod: Mapping[str, Any], peers: Iterable[Mapping[str, Any]]) -> bool:
        """Set the gate of ``pod`` True on its boot weights if no WeightUpdate governs it.

        ``peers`` are the WeightUpdates of the pod's namespace; the rule is
        :func:`~weightroll_operator.domain.admission.decide`. The write is conditional on the
        pod's ``resourceVersion`` (when it has one), so a WeightUpdate that claimed or drained the
        pod since this event was observed always wins.

        Never raises for the API: a vanished pod (404) is not an error; a conflict (409) means the
        pod changed, and that change's watch event decides again; any other error is logged and
        the pod stays NotReady (fail closed) until its next watch event retries.

        Returns:
            Whether the gate was written.
        """
        decision = admission.decide(pod, peers)
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        if not decision.admit:
            log.debug("Not admitting Pod %s/%s: %s", namespace, name, decision.message)
            return False
        try:
            await write_gate(
                self.kube,
                namespace,
                name,
                True,
                admission.AdmissionReason.ADMITTED,
                "Serving its boot weights: no WeightUpdate selects it",
                self.clock(),
                resource_version=meta.get("resourceVersion"),
            )
        except KubeNotFound:
            log.info("Skipped admission of Pod %s/%s: the pod is gone", namespace, name)
            return False
        except KubeConflict:
            log.info("Deferred admission of Pod %s/%s: the pod changed", namespace, name)
            return False
        except KubeError as e:
            log.warning("Failed to admit Pod %s/%s, it stays NotReady: %s", namespace, name, e)
            return False
        log.info(
            "Admitted Pod %s/%s serving its boot weights: no WeightUpdate selects it",
            namespace,
            name,
        )
        if self.metrics is not None:
            self.metrics.observe_admitted(namespace)
        return True

    async def admit_all(
        self,
        pods: Iterable[Mapping[str, Any]],
        peers: Iterable[Mapping[str, Any]],
        *,
        gone: str | None = None,
    ) -> int:
        """:meth:`admit` every pod of ``pods`` that awaits admission; return how many were.

        For the moment the WeightUpdate named ``gone`` is deleted (it is left out of ``peers``):
        the pods it selected but never touched get no watch event of their own.
        """
        peers = [p for p in peers if (p.get("metadata") or {}).get("name") != gone]
        count = 0
        for pod in pods:
            if admission.awaits_admission(pod):
                count += await self.admit(pod, peers)
        return count

    # ------------------------------------------------------------------------------------------

    async def _token(self, namespace: str, spec: WeightUpdateSpec) -> str | None:
        ref = spec.agent.token_secret_ref
        if ref is None:
            return None
        key = (namespace, ref.name, ref.key)
        cached = self._tokens.get(key)
        if cached is not None and cached[1] > self.monotonic():
            return cached[0]
        value = await self.kube.read_agent_token(namespace, ref.name, ref.key)
        self._tokens[key] = (value, self.monotonic() + self.token_ttl)
        return value

    async def _observe(
        self,
        views: tuple[PodView, ...],
        asked: Mapping[str, Query],
        token: str | None,
        cached: set[str] | None = None,
        *,
        fresh_only: bool = False,
    ) -> dict[str, AgentView]:
        """Ask each pod's agent what ``asked`` names; the names answered from the cache (an
        earlier pass's answer) are added to ``cached``; ``fresh_only`` asks every one anew."""
        if self._by_name is None or self._by_name[0] is not views:
            self._by_name = (views, {v.name: v for v in views})
        by_name = self._by_name[1]
        now = self.monotonic()
        seen: dict[str, AgentView] = {}
        todo: list[tuple[PodView, Query]] = []
        failures, states = self._agent_failures, self._states
        for name, query in asked.items():
            pod = by_name[name]
            failing = failures.get(_agent_key(pod)) if failures else None
            if failing is not None and failing[1] > now:
                seen[name] = failing[2]  # backing off: the last failure stands until then
                continue
            # Only a fresh answer may put a pod into traffic (restore, a joining pod): a cached
            # one serves pods in traffic only, whose agents' own readiness probes still guard.
            cacheable = query.update_id is None and pod.gate is True and not fresh_only
            hit = states.get((pod.namespace, pod.name)) if cacheable else None
            if hit is not None and hit[2] > now and (hit[3] is pod or self._same_key(hit[0], pod)):
                seen[name] = hit[1]
                if cached is not None:
                    cached.add(name)
            else:
                todo.append((pod, query))

        async def one(item: tuple[PodView, Query]) -> tuple[str, AgentView]:
            pod, query = item
            view = await self._ask(pod, query, token)
            self._note_agent(pod, view)
            return pod.name, view

        seen.update(await bounded_map(one, todo, self.concurrency))
        return seen

    def _same_key(self, key: tuple[str, ...], pod: PodView) -> bool:
        """``key == _state_key(pod)``, computed once per view object (views of unchanged pod
        objects are reused from pass to pass; see :meth:`_view`)."""
        known = self._state_keys.get((pod.namespace, pod.name))
        if known is None or known[0] is not pod:
            known = (pod, _state_key(pod))
            self._state_keys[(pod.namespace, pod.name)] = known
        return known[1] == key

    def _note_agent(self, pod: PodView, view: AgentView) -> None:
        """Back off exponentially (with jitter) from an agent that did not answer."""
        key = _agent_key(pod)
        if view.reachable or pod.ip is None:
            self._agent_failures.pop(key, None)
            return
        count = self._agent_failures.get(key, (0, 0.0, view))[0] + 1
        delay = backoff_delay(count, self.agent_backoff, self.agent_backoff_cap, self.rand)
        error = f"{view.error} (failed {count}x; next try in {delay:.1f}s)"
        if len(self._agent_failures) > 100_000:
            self._agent_failures.clear()
        self._agent_failures[key] = (
            count,
            self.monotonic() + delay,
            replace(view, error=error),
        )

    async def _ask(
        self, pod: PodView, query: Query, token: str | None, *, full: bool = False
    ) -> AgentView:
        """One agent observation; with an update id, also the live state once it committed
        (``full``: always), since only the live state can vouch for an attempt."""
        if pod.ip is None:
            return AgentView(reachable=False, error="pod has no IP yet")
        if pod.port is None:
            missing = f"pod has no container port named {AGENT_PORT_NAME!r}"
            return AgentView(reachable=False, error=missing)
        try:
            target = target_of(pod, token)
        except AgentError as e:
            return AgentView(reachable=False, error=str(e))
        if query.update_id is not None:
            try:
                update = await self.agents.get_update(target, query.update_id)
            except AgentError as e:
                return AgentView(reachable=False, error=str(e))
            if update is None:
                # Unknown id: not started yet, or the agent restarted and lost its records;
                # its state says whether it already serves this attempt (then no second load).
                return await self._ask(pod, Query(state=True), token)
            view = UpdateView(
                id=update.id,
                phase=update.phase,
                version=update.version,
                committed=bool(update.verdict and update.verdict.committed),
                reasons=tuple(update.verdict.reasons if update.verdict else ())
                or ((update.message,) if update.message else ()),
                started_at=update.started_at,
            )
            if update.phase is not UpdatePhase.COMMITTED and not full:
                return AgentView(reachable=True, version=update.version, update=view)
            live = await self._ask(pod, Query(state=True), token)
            return replace(live, update=view)
        key = _state_key(pod)
        try:
            state = await self.agents.state(target)
        except AgentError as e:
            return AgentView(reachable=False, error=str(e))
        src = state.source
        result = AgentView(
            reachable=True,
            version=state.version,
            ready=state.ready,
            source=None
            if src is None
            else SourceRef(uri=src.uri, manifest=src.manifest, manifest_digest=src.manifest_digest),
            active_update_id=state.active_update_id,
            clean=state.engine_state is EngineState.CLEAN,
            committed_update_id=state.committed_update_id,
            engine_seen=bool(state.ranks),
        )
        slot = (pod.namespace, pod.name)
        if slot not in self._states and len(self._states) >= self.cache_limit:
            self._states.clear()
        # Expiry spread over the second half of the TTL: the answers of one pass (the first
        # asks every agent) would otherwise all expire in one later pass, which then asks
        # thousands of agents at once (at 10,000 pods, a pass twice as long).
        ttl = self.state_ttl * (0.5 + 0.5 * self.rand())
        self._states[slot] = (key, result, self.monotonic() + ttl, pod)
        return result

    async def _token_unavailable(
        self,
        namespace: str,
        name: str,
        spec: WeightUpdateSpec,
        raw_status: Mapping[str, Any],
        old_status: WeightUpdateStatus | None,
        error: KubeError,
        now: datetime,
    ) -> None:
        """Report a token Secret that cannot be read (``credentials.py``); nothing else moves."""
        ref = spec.agent.token_secret_ref
        problem = None if ref is None else token_problem(error, namespace, ref)
        if problem is None:
            return  # transient (5xx, connection): retried without a word in status
        status = with_token_condition(old_status or WeightUpdateStatus(), problem, now)
        await self._write_status(namespace, name, raw_status, status)
        if self.metrics is not None:
            self.metrics.observe_token(namespace, name, problem.reason)

    async def _write_status(
        self,
        namespace: str,
        name: str,
        raw_status: Mapping[str, Any],
        status: WeightUpdateStatus,
    ) -> bool:
        patch = status_patch(dict(raw_status), status)
        if patch is None:
            return False
        await self.kube.patch_weightupdate_status(namespace, name, patch)
        return True

    async def _report_invalid(
        self,
        namespace: str,
        name: str,
        raw_status: Mapping[str, Any],
        old_status: WeightUpdateStatus | None,
        message: str,
        generation: int | None,
        now: datetime,
    ) -> None:
        """Status ``Failed`` with ``InvalidSpec``, and the phase gauge with it: without the
        gauge the ``WeightUpdateFailed`` alert never fired for an invalid spec."""
        status = invalid_status(old_status, message, generation, now)
        await self._write_status(namespace, name, raw_status, status)
        if self.metrics is not None:
            self.metrics.observe_phase(namespace, name, status.phase)

    async def _phase_event(
        self, ctx: ApplyContext, old: WeightUpdateStatus | None, new: WeightUpdateStatus
    ) -> None:
        before = old.phase.value if old is not None else "None"
        warning = new.phase in (Phase.FAILED, Phase.ROLLING_BACK)
        emit = Emit(
            Reason.PHASE_CHANGED, f"Phase changed from {before} to {new.phase.value}", warning
        )
        await apply([emit], ctx)

    def _observe_metrics(
        self,
        namespace: str,
        name: str,
        spec: WeightUpdateSpec,
        the_plan: Plan,
        old: WeightUpdateStatus | None,
        new: WeightUpdateStatus,
        agents: Mapping[str, AgentView],
        now: datetime,
        unwritten: frozenset[str] = frozenset(),
    ) -> None:
        m = self.metrics
        if m is None:
            return
        last = parse_time(new.last_progress_time)
        m.observe_status(
            namespace,
            name,
            new.phase,
            new.replicas,
            spec.strategy.progress_deadline_seconds,
            last.timestamp() if last else None,
        )
        start = parse_time(new.start_time)
        # A Succeeded rollout converging a new pod goes back through Progressing: count the
        # rollout once, when it first completes.
        reconverged = new.phase is Phase.SUCCEEDED and old is not None and old.completion_time
        m.observe_transition(
            namespace,
            name,
            new.phase if reconverged else old.phase if old is not None else None,
            new.phase,
            (now - start).total_seconds() if start else None,
        )
        new_failures = {
            a.pod.name: a.state.reason
            for a in the_plan.actions
            if isinstance(a, Settle)
            and a.state.state is UnitState.FAILED
            and a.pod.name not in unwritten  # counted when it is written (a later pass)
        }
        m.observe_units(namespace, name, the_plan.finished, the_plan.durations, new_failures)
        drained: dict[str, float] = {}
        for pod in the_plan.pods.values():
            st = pod.state
            held = st is not None and st.by == OwnerKey(f"{namespace}/{name}")
            if held and st is not None and (st.state.in_flight or st.state is UnitState.FAILED):
                started = parse_time(st.started_at)
                if started is not None:
                    drained[pod.name] = started.timestamp()
        m.observe_pods(namespace, name, drained, {n: not a.reachable for n, a in agents.items()})
        m.observe_pod_states(
            namespace,
            name,
            {
                pod.name: (
                    (pod.state.state.value, pod.state.version) if pod.state else ("Pending", "")
                )
                for pod in the_plan.pods.values()
            },
        )


def _agent_key(pod: PodView) -> tuple[str, str, str]:
    return (pod.namespace, pod.name, pod.incarnation)


def _state_key(pod: PodView) -> tuple[str, ...]:
    """A cached ``/v1/state`` answer is valid while the pod, its containers and our view of it
    are unchanged (a container restart changes ``incarnation``)."""
    state = pod.state
    return (
        pod.namespace,
        pod.name,
        pod.incarnation,
        "" if state is None else f"{state.state}|{state.version}|{state.update_id}",
        str(pod.gate),
    )


def _starts_units(the_plan: Plan, owner: OwnerKey) -> bool:
    """The plan claims a pod this WeightUpdate does not own yet (a unit starts, or a rollback
    drains a released pod); a new attempt on a pod it owns (a retarget) starts nothing."""
    return any(isinstance(a, Claim) and a.pod.owner != owner for a in the_plan.actions)


def _phase_of(body: Mapping[str, Any]) -> Phase:
    """The phase the WeightUpdate's status records (Pending when none can be read)."""
    try:
        return Phase((body.get("status") or {}).get("phase") or Phase.PENDING)
    except ValueError:
        return Phase.PENDING


def _orphan_state(owner: OwnerKey, spec: WeightUpdateSpec | None) -> WeightState:
    version = spec.version if spec is not None else "unknown"
    return WeightState(
        state=UnitState.FAILED,
        by=owner,
        version=version,
        update_id=UpdateId(make_update_id(owner.split("/")[-1], version)),
        reason="Released on deletion",
    )
