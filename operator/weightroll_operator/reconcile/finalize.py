"""Deletion: release every pod a deleted WeightUpdate owns.

The decision per pod is :func:`~weightroll_operator.domain.release.release`: running updates
are aborted, committed ones settled, pods whose agent is ready go back into traffic, the others
stay drained (their drained series stays exported, ``left_drained.py``). Up to two rounds run
(abort, then observe the verdict). Anything that cannot be released yet raises
:class:`ReleaseIncomplete`: the finalizer stays and deletion retries.

Order contract: called with the WeightUpdate's lock held (the Reconciler's), so a pass that
claimed a pod just before cannot be missed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from weightroll_operator.api.v1alpha1 import WeightUpdateSpec, parse_spec
from weightroll_operator.apply import ApplyContext, EventCounts, apply
from weightroll_operator.domain.actions import Emit
from weightroll_operator.domain.fleet import pod_view
from weightroll_operator.domain.model import (
    AgentView,
    OwnerKey,
    PodView,
    UnitState,
    UpdateId,
    WeightState,
    make_update_id,
)
from weightroll_operator.domain.plan import Query
from weightroll_operator.domain.release import release
from weightroll_operator.errors import InvalidSpec, KubeError, WeightrollError
from weightroll_operator.phantoms import Phantoms
from weightroll_operator.ports import AgentPort, KubePort
from weightroll_operator.reconcile.expectations import WriteExpectations
from weightroll_operator.reconcile.left_drained import LeftDrained
from weightroll_operator.reconcile.observe import AgentObserver

__all__ = ["Finalizer", "ReleaseIncomplete"]


class ReleaseIncomplete(WeightrollError):
    """Deletion could not release every pod yet; the finalizer stays and deletion retries."""


@dataclass
class Finalizer:
    """Releases the pods of deleted WeightUpdates (:meth:`release`)."""

    kube: KubePort
    agents: AgentPort
    clock: Callable[[], datetime]
    events: EventCounts
    phantoms: Phantoms
    observer: AgentObserver
    expectations: WriteExpectations
    left_drained: LeftDrained

    async def release(
        self,
        body: Mapping[str, Any],
        owner: OwnerKey,
        pods: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
    ) -> int:
        """Release every pod ``owner`` (the WeightUpdate ``body``) owns; return how many were.

        ``pods`` may be a function that reads the pod index: it is called now (the caller holds
        the lock). A pod whose view still predates our own last write to it cannot be judged
        yet: the release is retried.

        Raises:
            ReleaseIncomplete: some pods could not be released yet (agent unreachable or still
                winding down, a write failed, the index lags our write).
        """
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            spec: WeightUpdateSpec | None = parse_spec(body.get("spec"))
        except ValueError:
            spec = None
        views = self.expectations.mark_stale(
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
                token = await self.observer.token(namespace, spec)
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
            if not remaining or not any(n in outcome.pending for n in (v.name for v in remaining)):
                break
        self.left_drained.track(namespace, name, left)
        if remaining:
            why = {**(outcome.pending if outcome else {}), **failed}
            raise ReleaseIncomplete(
                "; ".join(f"{n}: {w}" for n, w in sorted(why.items())[:10]) or "release incomplete"
            )
        return released

    async def _observe_for_release(
        self, views: Iterable[PodView], token: str | None
    ) -> dict[str, AgentView]:
        """Every pod's state, and the update it runs for us (the verdict decides its release)."""
        asked = {
            v.name: Query(
                state=True,
                update_id=v.state.update_id
                if v.state is not None and v.state.state.running
                else None,
            )
            for v in views
        }
        by_name = {v.name: v for v in views}
        return await self.observer.ask_all(
            ((by_name[n], q) for n, q in asked.items()), token, full=True
        )


def _orphan_state(owner: OwnerKey, spec: WeightUpdateSpec | None) -> WeightState:
    version = spec.version if spec is not None else "unknown"
    return WeightState(
        state=UnitState.FAILED,
        by=owner,
        version=version,
        update_id=UpdateId(make_update_id(owner.split("/")[-1], version)),
        reason="Released on deletion",
    )
