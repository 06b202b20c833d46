"""Execute a plan's actions; return one result per action, never raise for "not yet".

Actions of one pod run in plan order and stop at the first error (the rest are reported as
skipped), so a ``GateOn`` never follows a failed step. Every pod write of a chain is
conditional: the first on the ``resourceVersion`` the plan observed, each later one on the
version the previous write produced. A pod that changed since it was observed (another
WeightUpdate claimed it, another operator replica wrote it, the kubelet updated it) answers 409
(``KubeConflict``): the chain stops and the next pass re-reads and re-plans, never overwriting.
Pods run concurrently, bounded by ``concurrency``. Events are posted after the pod actions. A
pod that disappeared (404) is not an error for the rollout: the next pass no longer sees it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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
)
from weightroll_operator.domain.conditions import timestamp
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    OwnerKey,
    PodView,
)
from weightroll_operator.errors import KubeConflict, KubeNotFound, WeightrollError
from weightroll_operator.ports import AgentPort, AgentTarget, KubePort

__all__ = ["ActionResult", "ApplyContext", "SKIPPED", "apply", "target_of", "write_gate"]

log = logging.getLogger(__name__)


class _Skipped(WeightrollError):
    """An earlier action of the same pod failed."""


SKIPPED = _Skipped("skipped: an earlier action of this pod failed")


@dataclass(frozen=True, slots=True)
class ActionResult:
    action: Action
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


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


def target_of(pod: PodView, token: str | None) -> AgentTarget:
    host = pod.ip or "0.0.0.0"
    host = f"[{host}]" if ":" in host else host
    return AgentTarget(pod=pod.name, base_url=f"http://{host}:{pod.port}", token=token)


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
    elif isinstance(action, AbortUpdate):
        await ctx.agents.abort_update(target_of(pod, ctx.token), action.update_id)
    elif isinstance(action, GateOn):
        message = f"Weights {action.version} committed on every rank"
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
            results.append(ActionResult(action))
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


def _event(emit: Emit, ctx: ApplyContext) -> dict[str, Any]:
    return {
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "namespace": ctx.namespace,
            "name": ctx.name,
            **({"uid": ctx.uid} if ctx.uid else {}),
        },
        "reason": emit.reason,
        "message": emit.message,
        "type": "Warning" if emit.warning else "Normal",
        "source": {"component": "weightroll-operator"},
        "firstTimestamp": timestamp(ctx.now),
        "lastTimestamp": timestamp(ctx.now),
        "count": 1,
    }


async def apply(actions: Sequence[Action], ctx: ApplyContext) -> list[ActionResult]:
    """Run ``actions``; see the module docstring for ordering and error rules."""
    by_pod: dict[str, list[PodAction]] = {}
    emits: list[Emit] = []
    for action in actions:
        if isinstance(action, Emit):
            emits.append(action)
        else:
            by_pod.setdefault(action.pod.name, []).append(action)
    sem = asyncio.Semaphore(ctx.concurrency)

    async def bounded(chain: list[PodAction]) -> list[ActionResult]:
        async with sem:
            return await _run_pod(chain, ctx)

    chains = await asyncio.gather(*(bounded(chain) for chain in by_pod.values()))
    results = [r for chain in chains for r in chain]

    async def post(emit: Emit) -> ActionResult:
        try:
            await ctx.kube.create_event(ctx.namespace, _event(emit, ctx))
            return ActionResult(emit)
        except WeightrollError as e:
            log.info("Failed to post Event %s: %s", emit.reason, e)
            return ActionResult(emit, e)

    results.extend(await asyncio.gather(*(post(e) for e in emits)))
    return results
