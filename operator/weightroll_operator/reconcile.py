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
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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
    apply,
    target_of,
    write_gate,
)
from weightroll_operator.credentials import token_problem, with_token_condition
from weightroll_operator.domain import admission
from weightroll_operator.domain.actions import AbortUpdate, Action, Emit, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.fleet import pod_view, select_pods
from weightroll_operator.domain.model import (
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
from weightroll_operator.domain.ownership import blocking_peers
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    Plan,
    Query,
    build_request,
    parse_time,
    plan,
    queries,
)
from weightroll_operator.domain.status import build_status, invalid_status, status_patch
from weightroll_operator.errors import (
    AgentError,
    InvalidSpec,
    KubeConflict,
    KubeError,
    KubeNotFound,
)
from weightroll_operator.metrics import Metrics
from weightroll_operator.ports import AgentPort, KubePort

__all__ = ["PassResult", "Reconciler", "utcnow"]

log = logging.getLogger(__name__)
_STATUS_KEYS = {f.alias or n for n, f in WeightUpdateStatus.model_fields.items()}


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


@dataclass
class Reconciler:
    """Runs passes for any number of WeightUpdates.

    Args:
        kube: the Kubernetes calls (``k8s.client.KubeApi``).
        agents: the agent calls (``agent_client.AgentClient``).
        metrics: optional metrics sink.
        clock: injected time (tests and the benchmark).
        state_ttl: seconds an agent ``/v1/state`` answer is reused for an unchanged pod.
        poll_interval: requeue delay while units are in flight.
        idle_interval: requeue delay otherwise.
    """

    kube: KubePort
    agents: AgentPort
    metrics: Metrics | None = None
    clock: Callable[[], datetime] = utcnow
    concurrency: int = 32
    state_ttl: float = 30.0
    token_ttl: float = 60.0
    poll_interval: float = 2.0
    idle_interval: float = 30.0
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _tokens: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)
    #: Per pod (namespace, name): the :func:`_state_key` the answer is valid for, the answer
    #: and its expiry (one entry per pod, like ``_views``).
    _states: dict[tuple[str, str], tuple[tuple[str, ...], AgentView, float]] = field(
        default_factory=dict
    )
    _views: dict[tuple[str, str], tuple[Mapping[str, Any], str | None, int, PodView]] = field(
        default_factory=dict
    )
    #: Entries of each cache before it is emptied (pods that vanished leave theirs behind).
    cache_limit: int = 100_000

    def _view(self, pod: Mapping[str, Any], group_by: str | None, port: int) -> PodView:
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
        if cached is not None and cached[0] is pod and cached[1:3] == (group_by, port):
            return cached[3]
        if cached is None and len(self._views) >= self.cache_limit:
            self._views.clear()
        result = pod_view(pod, group_by=group_by, default_port=port)
        self._views[key] = (pod, group_by, port, result)
        return result

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
            _check_wire(spec, name)
        except ValueError as e:
            status = invalid_status(old_status, str(e), generation, now)
            await self._write_status(namespace, name, raw_status, status)
            raise InvalidSpec(str(e)) from e

        views = select_pods(pods, spec, namespace, self._view)
        try:
            token = await self._token(namespace, spec)
        except KubeError as e:
            await self._token_unavailable(namespace, name, spec, raw_status, old_status, e, now)
            raise
        asked = queries(views, owner, spec.version)
        agents = await self._observe(views, asked, token)
        persisted = Persisted.from_status(old_status, spec.version)
        holding = blocking_peers(owner, persisted.start_time, views, peers)
        fleet = Fleet(name=name, owner=owner, pods=views, agents=agents, peers=holding)
        the_plan = plan(spec, fleet, persisted, now)
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
        )
        results = await apply(the_plan.actions, ctx)
        notes = {
            r.action.pod.name: f"{type(r.action).__name__}Failed: {r.error}"[:300]
            for r in results
            if r.error is not None
            and not isinstance(r.action, Emit)
            and r.error is not SKIPPED
            and not isinstance(r.error, KubeConflict)  # re-read and re-planned next pass
        }
        status = build_status(the_plan, spec, old_status, generation, now, notes)
        status = with_token_condition(status, None, now)
        if self.metrics is not None:
            self.metrics.observe_token(namespace, name, None)
        written = await self._write_status(namespace, name, raw_status, status)
        if old_status is None or old_status.phase is not status.phase:
            await self._phase_event(ctx, old_status, status)
        self._observe_metrics(namespace, name, spec, the_plan, old_status, status, agents, now)
        errors = tuple(r for r in results if not r.ok)
        # Only in-flight units need polling (their agents commit without a pod event); a pending
        # unit becomes startable on a pod event (a restore, a pod turning Ready), which wakes the
        # loop (loop.py).
        busy = the_plan.in_flight_units > 0
        return PassResult(
            phase=status.phase,
            status_written=written,
            actions=the_plan.actions,
            errors=errors,
            delay=self.poll_interval if busy else self.idle_interval,
        )

    async def finalize(self, body: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> int:
        """Stop a deleted WeightUpdate cleanly; return how many pods were released.

        In-flight units are aborted and stay drained (their agents are asked to abort); every
        pod the WeightUpdate owns is released, so nothing is left half-owned.
        """
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        owner = owner_key(namespace, name)
        async with self._locks.setdefault(owner, asyncio.Lock()):
            spec_port = 8470
            try:
                spec: WeightUpdateSpec | None = parse_spec(body.get("spec"))
            except ValueError:
                spec = None
            if spec is not None:
                spec_port = spec.agent.port
            now = self.clock()
            actions: list[Action] = []
            for raw in pods:
                pmeta = raw.get("metadata") or {}
                if pmeta.get("namespace") != namespace:
                    continue
                view = pod_view(raw, group_by=None, default_port=spec_port)
                if view.owner != owner:
                    continue
                st = view.state or _orphan_state(owner, spec)
                if st.state.in_flight:
                    actions.append(AbortUpdate(view, st.update_id))
                    st = st.evolve(
                        state=UnitState.FAILED, reason="Aborted: the WeightUpdate was deleted"
                    )
                actions.append(Settle(view, st, release=True))
            released = sum(1 for a in actions if isinstance(a, Settle))
            if released:
                actions.append(Emit(Reason.UNIT_ABORTED, f"Released {released} pods on deletion"))
            token = None
            if spec is not None:
                try:
                    token = await self._token(namespace, spec)
                except KubeError:
                    token = None
            ctx = ApplyContext(
                kube=self.kube,
                agents=self.agents,
                owner=owner,
                namespace=namespace,
                name=name,
                uid=meta.get("uid"),
                token=token,
                now=now,
            )
            await apply(actions, ctx)
            self._locks.pop(owner, None)
            if self.metrics is not None:
                self.metrics.forget(namespace, name)
            return released

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
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        value = await self.kube.read_secret_key(namespace, ref.name, ref.key)
        self._tokens[key] = (value, time.monotonic() + self.token_ttl)
        return value

    async def _observe(
        self, views: tuple[PodView, ...], asked: Mapping[str, Query], token: str | None
    ) -> dict[str, AgentView]:
        sem = asyncio.Semaphore(self.concurrency)
        by_name = {v.name: v for v in views}
        now = time.monotonic()
        seen: dict[str, AgentView] = {}
        todo: list[tuple[PodView, Query]] = []
        for name, query in asked.items():
            pod = by_name[name]
            cached = self._states.get((pod.namespace, pod.name))
            fresh = cached is not None and cached[0] == _state_key(pod) and cached[2] > now
            if cached is not None and fresh and query.update_id is None:
                seen[name] = cached[1]
            else:
                todo.append((pod, query))

        async def one(pod: PodView, query: Query) -> tuple[str, AgentView]:
            async with sem:
                return pod.name, await self._ask(pod, query, token)

        seen.update(await asyncio.gather(*(one(p, q) for p, q in todo)))
        return seen

    async def _ask(self, pod: PodView, query: Query, token: str | None) -> AgentView:
        if pod.ip is None:
            return AgentView(reachable=False, error="pod has no IP yet")
        target = target_of(pod, token)
        if query.update_id is not None:
            try:
                update = await self.agents.get_update(target, query.update_id)
            except AgentError as e:
                return AgentView(reachable=False, error=str(e))
            if update is None:
                # Unknown id: not started yet, or the agent restarted and lost its records;
                # its state says whether it already serves the version (then no second load).
                return await self._ask(pod, Query(state=True), token)
            view = UpdateView(
                id=update.id,
                phase=update.phase,
                version=update.version,
                committed=bool(update.verdict and update.verdict.committed),
                reasons=tuple(update.verdict.reasons if update.verdict else ())
                or ((update.message,) if update.message else ()),
            )
            return AgentView(reachable=True, version=update.version, update=view)
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
            source=None if src is None else SourceRef(uri=src.uri, manifest=src.manifest),
            active_update_id=state.active_update_id,
        )
        slot = (pod.namespace, pod.name)
        if slot not in self._states and len(self._states) >= self.cache_limit:
            self._states.clear()
        self._states[slot] = (key, result, time.monotonic() + self.state_ttl)
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
            if isinstance(a, Settle) and a.state.state is UnitState.FAILED
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


def _check_wire(spec: WeightUpdateSpec, name: str) -> None:
    """Specs the CRD schema cannot check: the source must be expressible on the agent wire."""
    probe = WeightState(
        state=UnitState.DRAINING,
        by=OwnerKey("-"),
        version=spec.version,
        update_id=make_update_id(name, spec.version),
    )
    try:
        build_request(spec, probe)
    except ValidationError as e:
        message = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise ValueError(f"spec.source: {message}") from e


def _orphan_state(owner: OwnerKey, spec: WeightUpdateSpec | None) -> WeightState:
    version = spec.version if spec is not None else "unknown"
    return WeightState(
        state=UnitState.FAILED,
        by=owner,
        version=version,
        update_id=UpdateId(make_update_id(owner.split("/")[-1], version)),
        reason="Released on deletion",
    )
