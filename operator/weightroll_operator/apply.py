"""Execute a plan's actions; return one result per action, never raise for "not yet".

Actions of one pod run in plan order and stop at the first error (the rest are reported as
skipped), so a ``GateOn`` never follows a failed step. Every pod write of a chain is
conditional: the first on the ``resourceVersion`` the plan observed, each later one on the
version the previous write produced. A pod that changed since it was observed (another
WeightUpdate claimed it, another operator replica wrote it, the kubelet updated it) answers 409
(``KubeConflict``): the chain stops and the next pass re-reads and re-plans, never overwriting.
Pods run concurrently, bounded by ``concurrency``. Events are posted after the pod actions: the
plan's ``Emit`` on the WeightUpdate, and on each pod the Events its succeeded actions mean
(``domain/pod_events.py``: drained, updating, verified, failed). A repeat of an Event already
posted on a pod raises its ``count`` (:class:`EventCounts`) instead of adding one. A pod that
disappeared (404) is not an error for the rollout: the next pass no longer sees it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast

from weightroll_operator.api.names import agent_address
from weightroll_operator.api.v1alpha1 import API_VERSION, KIND
from weightroll_operator.domain.actions import (
    AbortUpdate,
    Action,
    Claim,
    Emit,
    GateOff,
    GateOn,
    PodAction,
    Settle,
    StartUpdate,
    SwapUpdate,
)
from weightroll_operator.domain.conditions import timestamp
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    OwnerKey,
    PodView,
)
from weightroll_operator.domain.plan import emit_holding
from weightroll_operator.domain.pod_events import PodEvent, aggregate, pod_event
from weightroll_operator.errors import (
    AgentUnavailable,
    KubeConflict,
    KubeNotFound,
    WeightrollError,
)
from weightroll_operator.ports import AgentPort, AgentTarget, KubePort

__all__ = [
    "ActionResult",
    "ApplyContext",
    "EventCounts",
    "SKIPPED",
    "apply",
    "bounded_map",
    "target_of",
    "write_gate",
]

log = logging.getLogger(__name__)

_In = TypeVar("_In")
_Out = TypeVar("_Out")


async def bounded_map(
    call: Callable[[_In], Awaitable[_Out]], items: Sequence[_In], limit: int
) -> list[_Out]:
    """``[await call(x) for x in items]`` with up to ``limit`` calls in flight; results in order.

    ``limit`` workers take the items in turn, so 1,000 pods cost ``limit`` tasks, not 1,000
    tasks each waiting on a semaphore (a fifth of a pass at 10,000 pods). An exception ends
    its worker's loop; the other workers go on with the remaining items, and the first
    exception is raised only once they all stopped, so no call outlives the pass that made it.
    """
    results: list[_Out | None] = [None] * len(items)
    todo = iter(enumerate(items))

    async def worker() -> None:
        for i, item in todo:
            results[i] = await call(item)

    workers = (worker() for _ in range(max(1, min(limit, len(items)))))
    for outcome in await asyncio.gather(*workers, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
    return cast(list[_Out], results)


class _Skipped(WeightrollError):
    """An earlier action of the same pod failed."""


SKIPPED = _Skipped("skipped: an earlier action of this pod failed")


@dataclass(frozen=True, slots=True)
class ActionResult:
    action: Action
    error: Exception | None = None
    #: The pod's ``resourceVersion`` after the action, when the API server reported one (an
    #: agent call leaves it as it was): tells a view that predates the write (``reconcile``).
    resource_version: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class EventCounts:
    """Pod Events already posted by this process, for aggregation across passes.

    Keyed by what makes two Events the same (pod uid, reason, type, message); the value is the
    Event's name and count. Bounded (oldest forgotten first); after an operator restart a
    repeat is a new Event, as with client-go's in-memory correlator.
    """

    limit: int = 4096
    posted: OrderedDict[tuple[str, ...], tuple[str, int]] = field(default_factory=OrderedDict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def name_for(self, pod: str, now: datetime) -> str:
        """A new Event name, unique per process (kmock lacks ``generateName``)."""
        return f"{pod}.{int(now.timestamp() * 1e9):x}{next(self._seq):x}"

    def remember(self, key: tuple[str, ...], name: str, count: int) -> None:
        self.posted[key] = (name, count)
        self.posted.move_to_end(key)
        while len(self.posted) > self.limit:
            self.posted.popitem(last=False)


@dataclass(frozen=True, slots=True)
class ApplyContext:
    kube: KubePort
    agents: AgentPort
    owner: OwnerKey
    #: The WeightUpdate the Events are about.
    namespace: str
    name: str
    uid: str | None
    token: str | None
    now: datetime
    concurrency: int = 32
    #: Aggregation of pod Events across passes (the reconciler keeps one); ``None``: none.
    events: EventCounts | None = None


def target_of(pod: PodView, token: str | None) -> AgentTarget:
    """The agent of ``pod``: its IP and its container port named ``weightroll``, nothing else.

    Raises:
        AgentUnavailable: the pod has no IP or no such port (no request is made).
    """
    if pod.ip is None or pod.port is None:
        raise AgentUnavailable(f"{pod.name}: no pod IP or no container port named 'weightroll'")
    ip = agent_address(pod.ip)
    if ip is None:
        raise AgentUnavailable(f"{pod.name}: status.podIP is not a unicast pod address")
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    base_url = f"http://{host}:{pod.port}"
    return AgentTarget(pod=pod.name, base_url=base_url, token=token, namespace=pod.namespace)


async def write_gate(
    kube: KubePort,
    namespace: str,
    pod: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    *,
    resource_version: str | None = None,
) -> str | None:
    """Write the pod condition ``weightroll.io/weights-ready`` (the one way the gate is written).

    Args:
        resource_version: when given, the write succeeds only if the pod is still at this
            version (else :class:`~weightroll_operator.errors.KubeConflict`).

    Returns:
        The pod's ``resourceVersion`` after the write, when the API server reported one.

    Raises:
        KubeError: the API server refused the write (``KubeNotFound``: the pod is gone).
    """
    condition = {
        "type": CONDITION_WEIGHTS_READY,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": timestamp(now),
    }
    return await kube.patch_pod_condition(
        namespace, pod, condition, resource_version=resource_version
    )


async def _run_one(action: PodAction, ctx: ApplyContext, rv: str | None) -> str | None:
    """Run one action; ``rv`` is the pod version its write is conditional on; return the new one
    (agent calls leave it unchanged)."""
    pod = action.pod
    ns, name = pod.namespace, pod.name
    if isinstance(action, Claim):
        labels = {action.remove_label: None} if action.remove_label else None
        return await ctx.kube.patch_pod_metadata(
            ns,
            name,
            annotations={
                ANNOTATION_OWNER: action.owner,
                ANNOTATION_WEIGHT_STATE: action.state.to_json(),
            },
            labels=labels,
            resource_version=rv,
        )
    if isinstance(action, GateOff):
        return await write_gate(
            ctx.kube, ns, name, False, action.reason, action.message, ctx.now, resource_version=rv
        )
    if isinstance(action, StartUpdate):
        await ctx.agents.start_update(target_of(pod, ctx.token), action.request)
    elif isinstance(action, SwapUpdate):
        await ctx.agents.swap_update(target_of(pod, ctx.token), action.update_id)
    elif isinstance(action, AbortUpdate):
        await ctx.agents.abort_update(target_of(pod, ctx.token), action.update_id)
    elif isinstance(action, GateOn):
        message = action.message or f"Weights {action.version} committed on every rank"
        return await write_gate(
            ctx.kube, ns, name, True, action.reason, message, ctx.now, resource_version=rv
        )
    elif isinstance(action, Settle):
        annotations: dict[str, str | None] = {ANNOTATION_WEIGHT_STATE: action.state.to_json()}
        if action.release:
            annotations[ANNOTATION_OWNER] = None
        return await ctx.kube.patch_pod_metadata(
            ns,
            name,
            annotations=annotations,
            labels=dict(action.labels) or None,
            resource_version=rv,
        )
    return rv


async def _run_pod(actions: list[PodAction], ctx: ApplyContext) -> list[ActionResult]:
    results: list[ActionResult] = []
    failed = False
    rv = actions[0].pod.resource_version if actions else None
    for action in actions:
        if failed:
            results.append(ActionResult(action, SKIPPED))
            continue
        try:
            rv = await _run_one(action, ctx, rv)
            results.append(ActionResult(action, resource_version=rv))
        except KubeNotFound as e:
            log.info(
                "Skipped %s on Pod %s: the pod is gone", type(action).__name__, action.pod.name
            )
            results.append(ActionResult(action, e))
            failed = True
        except KubeConflict as e:
            log.info(
                "Deferred %s on Pod %s: the pod changed since it was read",
                type(action).__name__,
                action.pod.name,
            )
            results.append(ActionResult(action, e))
            failed = True
        except (WeightrollError, ValueError) as e:
            log.warning("Failed %s on Pod %s: %s", type(action).__name__, action.pod.name, e)
            results.append(ActionResult(action, e))
            failed = True
    return results


def _event_body(
    involved: dict[str, Any], reason: str, message: str, warning: bool, now: datetime
) -> dict[str, Any]:
    """An Event about ``involved`` (an object reference), first and last seen ``now``."""
    return {
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": "weightroll-operator"},
        "firstTimestamp": timestamp(now),
        "lastTimestamp": timestamp(now),
        "count": 1,
    }


def _event(emit: Emit, ctx: ApplyContext) -> dict[str, Any]:
    involved = {"apiVersion": API_VERSION, "kind": KIND, "namespace": ctx.namespace}
    involved |= {"name": ctx.name, **({"uid": ctx.uid} if ctx.uid else {})}
    return _event_body(involved, emit.reason, emit.message, emit.warning, ctx.now)


def _pod_event_body(event: PodEvent, ctx: ApplyContext, name: str) -> dict[str, Any]:
    pod = event.pod
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace, "name": pod.name}
    involved |= {"uid": pod.uid} if pod.uid else {}
    body = _event_body(involved, str(event.reason), event.message, event.warning, ctx.now)
    return {"metadata": {"name": name, "namespace": pod.namespace}, **body}


async def _post_pod_event(event: PodEvent, ctx: ApplyContext) -> None:
    """Post ``event``, or raise the count of the same Event posted before (then it is one)."""
    pod = event.pod
    counts = ctx.events if ctx.events is not None else EventCounts()
    kind = "Warning" if event.warning else "Normal"
    key = (pod.namespace, pod.name, pod.uid or "", str(event.reason), kind, event.message)
    known = counts.posted.get(key)
    if known is not None:
        name, count = known
        try:
            await ctx.kube.patch_event(
                pod.namespace, name, {"count": count + 1, "lastTimestamp": timestamp(ctx.now)}
            )
            counts.remember(key, name, count + 1)
            return
        except KubeNotFound:
            pass  # expired: post it anew
    name = counts.name_for(pod.name, ctx.now)
    await ctx.kube.create_event(pod.namespace, _pod_event_body(event, ctx, name))
    counts.remember(key, name, 1)


async def apply(actions: Sequence[Action], ctx: ApplyContext) -> list[ActionResult]:
    """Run ``actions``; see the module docstring for ordering and error rules."""
    by_pod: dict[str, list[PodAction]] = {}
    emits: list[Emit] = []
    for action in actions:
        if isinstance(action, Emit):
            emits.append(action)
        else:
            by_pod.setdefault(action.pod.name, []).append(action)

    async def run_pod(chain: list[PodAction]) -> list[ActionResult]:
        return await _run_pod(chain, ctx)

    chains = await bounded_map(run_pod, list(by_pod.values()), ctx.concurrency)
    results = [r for chain in chains for r in chain]
    # An Event reporting a pod write that did not happen is not true (yet): the next pass plans
    # the step again and posts it then (``Emit.pods``).
    unwritten = frozenset(
        r.action.pod.name for r in results if not r.ok and not isinstance(r.action, Emit)
    )
    emits = [h for e in emits if (h := emit_holding(e, unwritten)) is not None]

    async def post(emit: Emit) -> ActionResult:
        try:
            await ctx.kube.create_event(ctx.namespace, _event(emit, ctx))
            return ActionResult(emit)
        except WeightrollError as e:
            log.info("Failed to post Event %s: %s", emit.reason, e)
            return ActionResult(emit, e)

    results.extend(await asyncio.gather(*(post(e) for e in emits)))
    found = (
        pod_event(r.action, ctx.owner) for r in results if r.ok and not isinstance(r.action, Emit)
    )

    async def post_on_pod(event: PodEvent) -> None:
        try:
            await _post_pod_event(event, ctx)
        except WeightrollError as e:
            # The pod's story is a courtesy: the rollout goes on without it.
            log.info("Failed to post Event %s on Pod %s: %s", event.reason, event.pod.name, e)

    # Bounded like the pod writes: a batch of 1,000 verified pods is 1,000 Events.
    stories = list(aggregate(e for e in found if e is not None))
    await bounded_map(post_on_pod, stories, ctx.concurrency)
    return results
